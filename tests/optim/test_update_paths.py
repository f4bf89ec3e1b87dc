"""The final update (``optim/update.py``) by both of its paths: aten's fused SGD kernel (CPU
and CUDA, contiguous tensors) and the ``_foreach`` masked form (everything else, e.g. a
channels-last parameter). Each against the formula in float64 on fresh random tensors:
``d = ν·u + λw`` (``u = g`` without a preconditioned update), ``buf = μ·buf + d``
(``buf = d`` first), ``w ← w − lr·buf``; a False flag leaves every bit, and a plain
gradient is never written."""
from __future__ import annotations

import pytest
import torch

from tengrad_fx.optim import update
from tools.dispatch import SyncCounter


def _tensors(seed: int, channels_last: bool) -> tuple[list[torch.Tensor], dict[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3, 3, 3), (4,), (5, 4), (5,)]
    ps = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    if channels_last:
        ps[0] = ps[0].to(memory_format=torch.channels_last)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64)
    # preconditioned updates for the weights; the biases keep u = g
    updates = {ps[i]: torch.randn(ps[i].shape, generator=g, dtype=torch.float64) for i in (0, 2)}
    return ps, updates


@pytest.mark.parametrize("channels_last", [False, True], ids=["fused", "foreach"])
@pytest.mark.parametrize("kl", [False, True])
def test_update_matches_formula_over_steps(channels_last: bool, kl: bool) -> None:
    ps, _ = _tensors(0, channels_last)
    state: dict = {p: {} for p in ps}
    lr, mu, wd = 0.3, 0.9, 1e-2
    w = [p.detach().clone() for p in ps]
    buf: list = [None] * len(ps)
    for t in range(3):
        _, updates = _tensors(100 + t, channels_last)
        updates = {p: u for p, u in zip([ps[0], ps[2]], updates.values())}
        grads = [p.grad.clone() for p in ps]
        us = {p: u.clone() for p, u in updates.items()}
        nu = torch.tensor(0.37, dtype=torch.float64) if kl else None
        ok = torch.tensor(True)
        assert update._fusable(ps, [updates.get(p, p.grad) for p in ps], state, mu) == (not channels_last)
        update.apply_momentum_step(state, ps, updates, lr, mu, wd, nu, ok)
        for i, p in enumerate(ps):
            u = us[p] if p in us else grads[i]
            d = (u * nu if (kl and p in updates) else u) + wd * w[i]
            buf[i] = d if buf[i] is None else mu * buf[i] + d
            w[i] = w[i] - lr * buf[i]
            torch.testing.assert_close(p.detach(), w[i], rtol=1e-13, atol=1e-13)
            torch.testing.assert_close(state[p]["momentum_buffer"], buf[i], rtol=1e-13, atol=1e-13)
            assert torch.equal(p.grad, grads[i]), "a plain gradient was written"
            if p in us:
                assert torch.equal(updates[p], us[p]), "an update was written"


@pytest.mark.parametrize("channels_last", [False, True], ids=["fused", "foreach"])
def test_false_flag_keeps_every_bit_without_a_sync(channels_last: bool) -> None:
    ps, updates = _tensors(1, channels_last)
    state: dict = {p: {} for p in ps}
    update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 1e-3, None, torch.tensor(True))  # buffers exist
    ps[1].grad[0] = float("nan")
    updates[ps[0]][0, 0, 0, 0] = float("inf")
    bits = [p.detach().clone() for p in ps]
    bufs = [state[p]["momentum_buffer"].clone() for p in ps]
    with SyncCounter() as sc:
        update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 1e-3, torch.tensor(0.5, dtype=torch.float64),
                                   torch.tensor(False))
    assert sc.count == 0, dict(sc.ops)
    for b, p in zip(bits, ps):
        assert torch.equal(b.view(torch.int64), p.detach().view(torch.int64))
    for b, p in zip(bufs, ps):
        assert torch.equal(b.view(torch.int64), state[p]["momentum_buffer"].view(torch.int64))


def test_first_step_read_on_host_creates_no_buffer_when_skipped() -> None:
    ps, updates = _tensors(2, False)
    state: dict = {p: {} for p in ps}
    assert update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 0.0, None, torch.tensor(False)) is False
    assert all("momentum_buffer" not in state[p] for p in ps)
    assert update.apply_momentum_step(state, ps, updates, 0.1, 0.9, 0.0, None, torch.tensor(True)) is True
    assert all("momentum_buffer" in state[p] for p in ps)
