"""The final update (``optim/step/update.py``) by both of its paths: aten's fused SGD kernel (CPU
and CUDA, contiguous tensors) and the ``_foreach`` masked form (everything else, e.g. a
channels-last parameter). Each against the formula on fresh random tensors (float64, and
float32 where the fused kernel applies ``ν`` itself as ``grad_scale = 1/ν``):
``d = ν·u + λw`` (``u = g`` without a preconditioned update), ``buf = μ·buf + d``
(``buf = d`` first), ``w ← w − lr·buf``; a False flag leaves every bit, and a plain
gradient is never written (an update is, only as ``ν·u`` on the float32 fused path)."""
from __future__ import annotations

import pytest
import torch

from tengrad_fx.optim.step import update
from tengrad_fx.utils.dispatch import SyncCounter


def _tensors(seed: int, channels_last: bool, dtype: torch.dtype = torch.float64, device: str = "cpu",
             ) -> tuple[list[torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3, 3, 3), (4,), (5, 4), (5,)]
    ps = [torch.randn(s, generator=g, dtype=dtype).to(device) for s in shapes]
    if channels_last:
        ps[0] = ps[0].to(memory_format=torch.channels_last)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=dtype).to(device)
    # preconditioned updates for the weights; the biases keep u = g
    updates = {ps[i]: torch.randn(ps[i].shape, generator=g, dtype=dtype).to(device) for i in (0, 2)}
    return ps, updates


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("lr_as", ["float", "tensor"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("channels_last", [False, True], ids=["fused", "foreach"])
@pytest.mark.parametrize("kl", [False, True])
def test_update_matches_formula_over_steps(channels_last: bool, kl: bool, dtype: torch.dtype, lr_as: str,
                                           device: str) -> None:
    """``lr`` as a Python float or as a 0-d float64 device tensor (a CUDA graph's static lr):
    float64 steps to 1e-13 either way (a tensor lr read as float32 is off by ~1e-8)."""
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    ps, _ = _tensors(0, channels_last, dtype, device)
    state: dict = {p: {} for p in ps}
    lr_value, mu, wd = 0.3, 0.9, 1e-2
    lr = lr_value if lr_as == "float" else torch.tensor(lr_value, dtype=torch.float64, device=device)
    fusable = not channels_last and not (device == "cuda" and lr_as == "tensor" and dtype == torch.float64)
    w = [p.detach().clone() for p in ps]
    buf: list = [None] * len(ps)
    for t in range(3):
        _, updates = _tensors(100 + t, channels_last, dtype, device)
        updates = {p: u for p, u in zip([ps[0], ps[2]], updates.values())}
        grads = [p.grad.clone() for p in ps]
        us = {p: u.clone() for p, u in updates.items()}
        nu = torch.tensor(0.37, dtype=dtype, device=device) if kl else None
        ok = torch.tensor(True, device=device)
        assert update._fusable(ps, [updates.get(p, p.grad) for p in ps], state, mu, lr) == fusable
        update.apply_momentum_step(state, ps, updates, lr, mu, wd, nu, ok)
        for i, p in enumerate(ps):
            u = us[p] if p in us else grads[i]
            d = (u * nu if (kl and p in updates) else u) + wd * w[i]
            buf[i] = d if buf[i] is None else mu * buf[i] + d
            w[i] = w[i] - lr_value * buf[i]
            torch.testing.assert_close(p.detach(), w[i], rtol=tol, atol=tol)
            torch.testing.assert_close(state[p]["momentum_buffer"], buf[i], rtol=tol, atol=tol)
            assert torch.equal(p.grad, grads[i]), "a plain gradient was written"
            if p in us and kl and dtype == torch.float32 and fusable:  # the kernel's ν·u
                torch.testing.assert_close(updates[p], us[p] * nu, rtol=1e-6, atol=1e-7)
            elif p in us:
                assert torch.equal(updates[p], us[p]), "an update was written"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("channels_last", [False, True], ids=["fused", "foreach"])
def test_false_flag_keeps_every_bit_without_a_sync(channels_last: bool, dtype: torch.dtype) -> None:
    ps, updates = _tensors(1, channels_last, dtype)
    state: dict = {p: {} for p in ps}
    update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 1e-3, None, torch.tensor(True))  # buffers exist
    ps[1].grad[0] = float("nan")
    updates[ps[0]][0, 0, 0, 0] = float("inf")
    bits = [p.detach().clone() for p in ps]
    bufs = [state[p]["momentum_buffer"].clone() for p in ps]
    with SyncCounter() as sc:
        update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 1e-3, torch.tensor(0.5, dtype=dtype),
                                   torch.tensor(False))
    assert sc.count == 0, dict(sc.ops)
    ints = torch.int64 if dtype == torch.float64 else torch.int32
    for b, p in zip(bits, ps):
        assert torch.equal(b.view(ints), p.detach().view(ints))
    for b, p in zip(bufs, ps):
        assert torch.equal(b.view(ints), state[p]["momentum_buffer"].view(ints))


def test_first_step_read_on_host_creates_no_buffer_when_skipped() -> None:
    ps, updates = _tensors(2, False)
    state: dict = {p: {} for p in ps}
    assert update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 0.0, None, torch.tensor(False)) is False
    assert all("momentum_buffer" not in state[p] for p in ps)
    assert update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 0.0, None, torch.tensor(True)) is True
    assert all("momentum_buffer" in state[p] for p in ps)


def test_an_update_that_is_a_gradient_is_not_scaled_in_place() -> None:
    """``ν`` goes into the fused kernel only for updates of their own storage: an update
    that is (a view of) the parameter's ``.grad`` takes ``ν·u`` out of place, so the
    gradient keeps its bits."""
    ps, _ = _tensors(3, False, torch.float32)
    grads = [p.grad.clone() for p in ps]
    updates = {ps[0]: ps[0].grad.view(ps[0].shape), ps[2]: torch.randn(ps[2].shape)}
    u2 = updates[ps[2]].clone()
    state: dict = {p: {} for p in ps}
    nu = torch.tensor(0.25)
    update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 0.0, nu, torch.tensor(True))
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, grads))
    torch.testing.assert_close(state[ps[0]]["momentum_buffer"], grads[0] * 0.25)
    torch.testing.assert_close(state[ps[2]]["momentum_buffer"], u2 * 0.25)
    torch.testing.assert_close(state[ps[1]]["momentum_buffer"], grads[1])
