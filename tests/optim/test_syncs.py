"""A warmed-up TENGraD step reads nothing back from the device (0 host syncs).

Counted with ``tengrad_fx.utils.dispatch.SyncCounter`` (a TorchDispatchMode) around ``opt.step()``:
scalar reads (``_local_scalar_dense``: ``.item()``, ``bool``, ``float``), ``is_nonzero``,
``equal``, ``tolist``, host-checked linalg errors, data-dependent shapes (``nonzero``,
boolean-mask indexing) and blocking device→CPU copies. On this CPU machine none of them
waits, but each one would on a GPU.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.utils.dispatch import SyncCounter


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.ReLU(), nn.Linear(8, 5),
    )


def _batches(n: int, m: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(m, 1, 6, 6, generator=g), torch.randint(0, 5, (m,), generator=g)) for _ in range(n)]


def _setup(**kw):
    x0 = _batches(1)[0][0]
    model = tengrad_fx.prepare(_model(), example_inputs=(x0[:2],))
    args = dict(lr=0.05, damping=0.1, momentum=0.9, weight_decay=1e-3, kl_clip=1e-3, curvature_every=1)
    args.update(kw)
    fused = args.pop("fused", False)
    opt = TENGraD(model, **args, compile=fused)
    if fused:
        opt._fused.fn = None  # the fused update, eagerly
    return model, opt


def _forward_backward(model, opt, x, y) -> None:
    opt.zero_grad()
    out = model(x)
    opt.mc_capture(out)
    F.cross_entropy(out, y).backward()


CASES = {
    "empirical-T1": dict(),
    "empirical-T3": dict(curvature_every=3),
    "mc-T1": dict(fisher="mc"),
    "mc-T3": dict(fisher="mc", curvature_every=3),
    "woodbury-T1": dict(update_form="woodbury"),
    "fused-T3": dict(fused=True, curvature_every=3),
    "no-clip-no-momentum": dict(kl_clip=None, momentum=0.0, weight_decay=0.0, curvature_every=2),
    "newton-schulz-T3": dict(curvature_every=3, orthogonalize="newton-schulz", graft="rmsprop"),
    "graft-sgd-T3": dict(curvature_every=3, graft="sgd"),
    "subsampled-T3": dict(curvature_every=3, curvature_samples=4, fisher="mc"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_warm_step_has_no_host_sync(case: str) -> None:
    model, opt = _setup(**CASES[case])
    batches = _batches(9)
    kinds = set()
    for t, (x, y) in enumerate(batches):
        _forward_backward(model, opt, x, y)
        kind = "curvature" if opt._is_curvature_step() else "reuse"
        before = [p.detach().clone() for p in model.parameters()]
        with SyncCounter() as sc:
            opt.step()
        if t >= 3:  # warmed up: momentum buffers exist, materialization chosen
            assert sc.count == 0, (case, kind, dict(sc.ops))
            kinds.add(kind)
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    want = {"curvature", "reuse"} if "T1" not in case else {"curvature"}
    assert kinds == want
    assert opt.counters == {"step": 9, "skipped": 0, "uncaptured": 0}


def test_skip_is_decided_on_device_and_leaves_bits_unchanged() -> None:
    """A NaN gradient in steady state: no sync, parameters and momentum buffers keep every
    bit (a −0.0 weight stays −0.0), the warning and the count arrive without a wait, and
    with ``curvature_every > 1`` the next step takes curvature again."""
    model, opt = _setup(curvature_every=4)
    batches = _batches(6)
    for x, y in batches[:2]:
        _forward_backward(model, opt, x, y)
        opt.step()
    w = model.get_parameter("0.weight")
    with torch.no_grad():
        w[0, 0, 0, 0] = -0.0
    x, y = batches[2]
    _forward_backward(model, opt, x, y)
    model.get_parameter("5.weight").grad[0, 0] = float("nan")
    bits = [p.detach().clone().view(torch.int32) for p in model.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone().view(torch.int32) for p in model.parameters()]
    assert not opt._is_curvature_step()
    with warnings.catch_warnings(record=True) as caught, SyncCounter() as sc:
        warnings.simplefilter("always")
        opt.step()
    assert sc.count == 0, dict(sc.ops)
    for b, p in zip(bits, model.parameters()):
        assert torch.equal(b, p.detach().view(torch.int32))
    for b, p in zip(bufs, model.parameters()):
        assert torch.equal(b, opt.state[p]["momentum_buffer"].view(torch.int32))
    assert [str(c.message) for c in caught if "TENGraD" in str(c.message)], "no skip warning"
    assert opt._is_curvature_step(), "a seen skip re-captures curvature on the next step"
    assert opt.counters == {"step": 2, "skipped": 1, "uncaptured": 0}
    x, y = batches[3]
    _forward_backward(model, opt, x, y)
    opt.step()
    assert opt.counters == {"step": 3, "skipped": 1, "uncaptured": 0}
    assert not opt._is_curvature_step()


def test_sync_counter_sees_each_kind_of_host_read() -> None:
    t = torch.tensor([1.0, -2.0])
    with SyncCounter() as sc:
        t.sum().item()
        bool(t[0] > 0)
        t.tolist()
        torch.linalg.cholesky(torch.eye(2))
        t[t > 0]
    assert sc.count == 5, dict(sc.ops)
    with SyncCounter() as sc:
        torch.linalg.cholesky_ex(torch.eye(2))
        torch.where(t > 0, t, 0.0)
    assert sc.count == 0, dict(sc.ops)


@pytest.mark.parametrize("T", [1, 3])  # a push-through curvature step, a reuse step (both with the KL clip)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["preconditioned", "fallback"])
def test_non_finite_gradient_skips_whether_preconditioned_or_not(T: int, value: float, where: str) -> None:
    """The step's finiteness check takes the preconditioned parameters' gradients from
    their ``Σ‖g‖²`` (read for the KL clip; their ``u = β·g + γ·Jᵀc`` carries a non-finite
    ``g`` too, as ``0·inf`` is NaN) and reads only the others' (here a BatchNorm left to
    SGD by ``only_linear_conv``): a NaN or inf in either skips the step on the device,
    every bit of the parameters and momentum buffers kept."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 5))
    batches = _batches(4)
    model = tengrad_fx.prepare(net, example_inputs=(batches[0][0][:2],), only_linear_conv=True)
    opt = TENGraD(model, lr=0.05, damping=0.1, momentum=0.9, kl_clip=1e-3, curvature_every=T)
    for x, y in batches[:2]:
        _forward_backward(model, opt, x, y)
        opt.step()
    assert opt._is_curvature_step() == (T == 1)
    x, y = batches[2]
    _forward_backward(model, opt, x, y)
    poisoned = model.get_parameter("0.weight" if where == "preconditioned" else "1.weight")
    poisoned.grad.view(-1)[3] = value
    bits = [p.detach().clone() for p in model.parameters()]
    bufs = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    with warnings.catch_warnings(), SyncCounter() as sc:
        warnings.simplefilter("ignore")
        opt.step()
    assert sc.count == 0, dict(sc.ops)
    assert opt.last_result is not None and opt.last_result.grad_sq is not None  # Σ‖g‖² from the preconditioner
    assert opt.counters["skipped"] == 1
    for b, p in zip(bits, model.parameters()):
        assert torch.equal(b.view(torch.int32), p.detach().view(torch.int32))
    for b, p in zip(bufs, model.parameters()):
        assert torch.equal(b.view(torch.int32), opt.state[p]["momentum_buffer"].view(torch.int32))
