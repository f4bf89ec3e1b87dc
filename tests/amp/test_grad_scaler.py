"""``torch.amp.GradScaler`` with TENGraD (and a baseline): the step sees unscaled
gradients and unscaled records, and a step the scaler skips leaves parameters,
momentum and curvature bit for bit unchanged. CPU (``GradScaler("cpu")``, bf16 autocast)
and a CUDA twin (fp16, the usual GradScaler setting), skipped without CUDA.

A power-of-two loss scale makes scaling and unscaling exact, so a scaled run must equal
the unscaled run bit for bit."""
from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx

from testing.all_kinds import AllKinds

SCALE = 2.0 ** 10


def _batches(n: int, m: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(m, 3, 6, 6, generator=g).to(device), torch.randint(0, 11, (m, 4), generator=g).to(device),
             torch.randint(0, 5, (m,), generator=g).to(device)) for _ in range(n)]


def _setup(method: str, device: str, scaler: Optional[torch.amp.GradScaler], fisher: str = "empirical"):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    net = AllKinds().to(device)
    x, idx, _ = _batches(1, 4, device)[0]
    pm = tengrad_fx.prepare(net, example_inputs=(x, idx))
    if method == "tengrad":
        opt = tengrad_fx.TENGraD(pm, lr=0.05, damping=0.1, curvature_every=2, kl_clip=0.01, fisher=fisher,
                                 grad_scaler=scaler)
    else:
        opt = tengrad_fx.KFAC(pm, lr=0.05, damping=0.1, curvature_every=2, inverse_every=2, fisher=fisher,
                              grad_scaler=scaler)
    return pm, opt


def _step(pm: Any, opt: Any, batch: tuple, scaler: Optional[torch.amp.GradScaler], device: str,
          dtype: torch.dtype, unscale: bool = False, poison: bool = False) -> None:
    """One training iteration; ``poison`` puts an inf into one gradient after the backward
    (what an fp16 overflow does)."""
    x, idx, y = batch
    with torch.autocast(device, dtype):
        out = pm(x, idx)
    loss = F.cross_entropy(out.float(), y)
    opt.zero_grad()
    opt.mc_capture(out)
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()
    if poison:
        pm.fc.weight.grad[0, 0] = float("inf")
    if scaler is None:
        opt.step()
        return
    if unscale:
        scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def _train(method: str, device: str, dtype: torch.dtype, scaled: bool, unscale: bool = False,
           fisher: str = "empirical", n: int = 4) -> dict[str, torch.Tensor]:
    scaler = torch.amp.GradScaler(device, init_scale=SCALE) if scaled else None
    pm, opt = _setup(method, device, scaler, fisher)
    for batch in _batches(n, 8, device):
        _step(pm, opt, batch, scaler, device, dtype, unscale)
    assert opt.counters["step"] == n and opt.counters["skipped"] == 0
    return {k: p.detach().clone() for k, p in pm.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool = True,
                 across_runs: bool = False) -> None:
    """Bit-identical parameters; or (``exact=False``: fp16, where a scale changes which
    values underflow) the displacement from the initial weights within 5 % (relative
    2-norm over all parameters; a record left scaled by 2¹⁰ changes it by far more)."""
    assert a.keys() == b.keys()
    if exact and across_runs and next(iter(a.values())).is_cuda:
        # two runs on CUDA: the embedding backward / index_add accumulate with atomics, so two
        # identical runs already differ in the last bits; "bit-identical" becomes fp32 rounding
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)
        return
    if exact:
        for k in a:
            assert torch.equal(a[k], b[k]), k
        return
    w0 = _initial(next(iter(a.values())).device.type)
    da = torch.cat([(a[k] - w0[k]).flatten() for k in a])
    db = torch.cat([(b[k] - w0[k]).flatten() for k in a])
    assert ((da - db).norm() / db.norm()).item() <= 5e-2


def _initial(device: str) -> dict[str, torch.Tensor]:
    pm, _ = _setup("tengrad", device, None)
    return {k: p.detach().clone() for k, p in pm.named_parameters()}


CASES = [("tengrad", False, "empirical"), ("tengrad", True, "empirical"), ("tengrad", False, "mc"),
         ("kfac", False, "empirical")]


def _check_scaled_equals_unscaled(device: str, dtype: torch.dtype, method: str, unscale: bool, fisher: str) -> None:
    ref = _train(method, device, dtype, scaled=False, fisher=fisher)
    got = _train(method, device, dtype, scaled=True, unscale=unscale, fisher=fisher)
    _assert_same(got, ref, exact=dtype != torch.float16, across_runs=True)


@pytest.mark.filterwarnings("ignore:no Kronecker-factored curvature")
@pytest.mark.parametrize("method,unscale,fisher", CASES)
def test_scaled_run_equals_unscaled_run(method: str, unscale: bool, fisher: str) -> None:
    """4 steps (curvature on steps 0 and 2, reused on 1 and 3) with the loss scaled by
    2¹⁰: bit-identical to the unscaled run, so gradients AND records were unscaled (a
    Gram left scaled would be 2²⁰ times too large). With ``scaler.unscale_(opt)`` before
    the step too, with the MC Fisher (its own backward scaled and unscaled), and for K-FAC."""
    _check_scaled_equals_unscaled("cpu", torch.bfloat16, method, unscale, fisher)


def _snapshot(pm: Any, opt: Any) -> dict[str, Any]:
    snap: dict[str, Any] = {f"p:{k}": p.detach().clone() for k, p in pm.named_parameters()}
    for k, p in pm.named_parameters():
        buf = opt.state[p].get("momentum_buffer")
        snap[f"m:{k}"] = None if buf is None else buf.clone()
    snap["chol"] = opt.curvature.chol.clone()
    snap["K"] = [K.clone() for K in opt.curvature.K]
    snap["sched"] = opt._sched
    snap["curv_sched"] = opt.curvature.sched
    return snap


def _assert_snapshot(a: dict[str, Any], b: dict[str, Any]) -> None:
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], list):
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
        else:
            assert a[k] == b[k], k


def _check_skip_on_curvature_step(device: str, dtype: torch.dtype) -> None:
    scaler = torch.amp.GradScaler(device, init_scale=SCALE)
    pm, opt = _setup("tengrad", device, scaler)
    batches = _batches(4, 8, device)
    _step(pm, opt, batches[0], scaler, device, dtype)
    _step(pm, opt, batches[1], scaler, device, dtype)
    assert opt._is_curvature_step()
    before = _snapshot(pm, opt)
    _step(pm, opt, batches[2], scaler, device, dtype, poison=True)
    _assert_snapshot(before, _snapshot(pm, opt))
    assert opt.counters["skipped"] == 1 and opt.counters["step"] == 2
    assert scaler.get_scale() == SCALE / 2  # the scaler saw the overflow (backoff)
    assert opt._is_curvature_step()  # the next step takes the curvature the skipped one did not
    _step(pm, opt, batches[2], scaler, device, dtype)
    _step(pm, opt, batches[3], scaler, device, dtype)
    # equal to a run that never met the overflow
    scaler_ref = torch.amp.GradScaler(device, init_scale=SCALE)
    ref_pm, ref_opt = _setup("tengrad", device, scaler_ref)
    for b in batches:
        _step(ref_pm, ref_opt, b, scaler_ref, device, dtype)
    _assert_same({k: p.detach() for k, p in pm.named_parameters()},
                 {k: p.detach() for k, p in ref_pm.named_parameters()},
                 exact=dtype != torch.float16, across_runs=True)


def test_skipped_curvature_step_changes_nothing() -> None:
    """An overflow on a curvature step: parameters, momentum buffers, Grams, Cholesky
    factors and the schedule keep their bits; the scaler backs off; the next iteration
    takes the curvature, and the run ends bit-identical to one without the overflow."""
    _check_skip_on_curvature_step("cpu", torch.bfloat16)


def _check_skip_on_reuse_step(device: str, dtype: torch.dtype) -> None:
    scaler = torch.amp.GradScaler(device, init_scale=SCALE)
    pm, opt = _setup("tengrad", device, scaler)
    batches = _batches(3, 8, device)
    _step(pm, opt, batches[0], scaler, device, dtype)
    assert not opt._is_curvature_step()
    before = _snapshot(pm, opt)
    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("error")  # scaler skips are counted, not warned about
        _step(pm, opt, batches[1], scaler, device, dtype, poison=True)
    after = _snapshot(pm, opt)
    del before["sched"], after["sched"]  # a device-side skip advances the schedule (skeleton docs)
    _assert_snapshot(before, after)
    assert opt.counters["skipped"] == 1 and opt.counters["step"] == 1
    assert scaler.get_scale() == SCALE / 2


def test_skipped_reuse_step_changes_nothing() -> None:
    """An overflow on a step that reuses the curvature (no host read: the non-finite
    gradient masks the update on the device): parameters, momentum and the cached
    curvature keep their bits."""
    _check_skip_on_reuse_step("cpu", torch.bfloat16)


def test_scaler_misuse_is_refused() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    pm, opt = _setup("tengrad", "cpu", None)
    before = {k: p.detach().clone() for k, p in pm.named_parameters()}
    with pytest.raises(ValueError, match="grad_scaler=scaler"):
        _step(pm, opt, _batches(1, 8, "cpu")[0], scaler, "cpu", torch.bfloat16)
    _assert_same(before, {k: p.detach() for k, p in pm.named_parameters()})
    pm, opt = _setup("tengrad", "cpu", torch.amp.GradScaler("cpu", init_scale=SCALE))
    with pytest.raises(RuntimeError, match="scaler.step"):
        _step(pm, opt, _batches(1, 8, "cpu")[0], None, "cpu", torch.bfloat16)
    with pytest.raises(TypeError, match="GradScaler"):
        tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, grad_scaler=object())  # type: ignore[arg-type]
    # a disabled scaler is a plain loop
    off = torch.amp.GradScaler("cpu", enabled=False)
    pm, opt = _setup("tengrad", "cpu", off)
    _step(pm, opt, _batches(1, 8, "cpu")[0], off, "cpu", torch.bfloat16)
    assert opt.counters["step"] == 1


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_scaler_twin(dtype: torch.dtype) -> None:
    """The CPU tests on CUDA: bf16 autocast (bit-identical as on CPU) and fp16, GradScaler's
    usual setting, where the comparisons across scales are within 5 % (fp16 underflow
    depends on the scale; the skipped steps are still checked bit for bit)."""
    for method, unscale, fisher in CASES:
        _check_scaled_equals_unscaled("cuda", dtype, method, unscale, fisher)
    _check_skip_on_curvature_step("cuda", dtype)
    _check_skip_on_reuse_step("cuda", dtype)
