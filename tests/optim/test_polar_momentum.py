"""``TENGraD(orthogonalize=..., orthogonalize_momentum=True)``: the polar factor of the momentum.

Exactness in float64 against a reference built here from dense NGD updates
(``testing.tengrad_step.dense_u``) and ``torch.linalg.svd``: each orthogonalized weight
takes ``b ← μb + u``, ``v = u + μb`` (Nesterov), ``w ← w − lr·(polar(v) + λw)``; every
other parameter the heavy ball on its own update, ``buf ← μ·buf + u + λw``,
``w ← w − lr·buf``. A skipped step keeps the momentum's bits; a resumed run continues bit
for bit; the CUDA-graph path equals the eager one.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad.shaping import POLAR_MOMENTUM
from tengrad_fx.solve import POLAR_FLOOR
from testing.oracle import newton_schulz_reference
from testing.tengrad_step import (
    assert_graphs_match_eager, batch, dense_u, forward_backward, layer_params, recorded_step, rel, setup,
)

MU, WD, LR = 0.9, 0.01, 0.3


def _polar(u: torch.Tensor, method: str) -> torch.Tensor:
    """The polar factor of ``u`` viewed ``[shape[0], -1]`` at RMS 0.2 (exact by the SVD, or
    Muon's quintic on its singular values)."""
    mat = u.reshape(u.shape[0], -1)
    if method == "newton-schulz":
        q = newton_schulz_reference(mat)
    else:
        left, sv, right = torch.linalg.svd(mat, full_matrices=False)
        q = left * (sv / sv.clamp(min=POLAR_FLOOR * sv[0])) @ right
    return (q * (0.2 * max(mat.shape) ** 0.5)).reshape(u.shape)


@pytest.mark.parametrize("method", ["eigh", "newton-schulz"])
@pytest.mark.parametrize("split", [False, True])
def test_step_equals_momentum_then_polar_reference(method: str, split: bool) -> None:
    """Three curvature steps; ``split``: the last layer in a group with ``orthogonalize``
    False (its weight takes the heavy ball on its NGD update, as the biases do)."""
    template, model, _ = setup("mlp")
    params = list(model.parameters())
    groups = [dict(params=params[:-2]), dict(params=params[-2:], orthogonalize=False)] if split else None
    opt = TENGraD(model, lr=LR, damping=0.05, momentum=MU, weight_decay=WD, curvature_every=1, kl_clip=None,
                  orthogonalize=method, orthogonalize_momentum=True, params=groups)
    names = [n for n, _ in model.named_parameters()]
    polar = {n for n, p in model.named_parameters() if p.ndim >= 2 and not (split and n in names[-2:])}
    layers = layer_params(model)
    history: dict[str, list[torch.Tensor]] = {}
    bufs: dict[str, torch.Tensor] = {}
    for t in (1, 2, 3):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        ref_model, x, y, g = recorded_step(template, model, opt, t, history)
        u = dense_u(ref_model, x, y, F.cross_entropy, g, 0.05, layers)
        expect = {}
        for n, un in u.items():
            if n in polar:
                bufs[n] = MU * bufs.get(n, torch.zeros_like(un)) + un
                expect[n] = LR * (_polar(un + MU * bufs[n], method) + WD * before[n])
            else:
                d = un + WD * before[n]
                bufs[n] = MU * bufs[n] + d if n in bufs else d
                expect[n] = LR * bufs[n]
        opt.step()
        for n, p in model.named_parameters():
            err = rel(before[n] - p.detach(), expect[n])
            assert err <= 1e-9, f"step {t}, {n}: rel err {err:.2e}"
    assert {n for n, p in model.named_parameters() if POLAR_MOMENTUM in opt.state[p]} == polar
    assert all("momentum_buffer" not in opt.state[p] for n, p in model.named_parameters() if n in polar)


def test_skipped_step_keeps_the_momentum_bits() -> None:
    """A NaN gradient in a bias (not an orthogonalized weight): the step is skipped, the
    momentum kept before the polar factor and every parameter keep their bits."""
    _, model, opt = setup("mlp", orthogonalize="newton-schulz", orthogonalize_momentum=True, momentum=MU, lr=LR)
    forward_backward(model, opt, *batch("mlp", 8, 1))
    opt.step()
    forward_backward(model, opt, *batch("mlp", 8, 2))
    list(model.parameters())[-1].grad.view(-1)[0] = float("nan")
    state = [(opt.state[p][POLAR_MOMENTUM].clone()) for p in model.parameters() if POLAR_MOMENTUM in opt.state[p]]
    bits = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.counters["skipped"] == 1 and state
    after = [opt.state[p][POLAR_MOMENTUM] for p in model.parameters() if POLAR_MOMENTUM in opt.state[p]]
    assert all(torch.equal(a, b) for a, b in zip(state, after))
    assert all(torch.equal(b, p.detach()) for b, p in zip(bits, model.parameters()))


def test_resumes_bit_for_bit_and_differs_from_the_heavy_ball() -> None:
    """Saved after two steps, a loaded optimizer continues as the uninterrupted run, bit for
    bit; the option changes the trajectory (it is not the heavy ball on the polar factors)."""
    kw = dict(orthogonalize="newton-schulz", momentum=MU, lr=0.1, curvature_every=3)

    def run(stop: int | None, first: bool = True) -> dict[str, torch.Tensor]:
        _, model, opt = setup("mlp", orthogonalize_momentum=first, **kw)
        for t in range(5):
            if t == stop:
                sd, params = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
                _, model, opt = setup("mlp", orthogonalize_momentum=first, **kw)
                model.load_state_dict(params)
                opt.load_state_dict(sd)
            forward_backward(model, opt, *batch("mlp", 8, t))
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    whole, resumed, heavy = run(None), run(2), run(None, first=False)
    assert all(torch.equal(whole[n], resumed[n]) for n in whole)
    assert max(float((whole[n] - heavy[n]).abs().max()) for n in whole) > 1e-3


def test_needs_orthogonalize_and_a_bool() -> None:
    with pytest.raises(ValueError, match="orthogonalize_momentum=True .* needs orthogonalize"):
        setup("mlp", orthogonalize_momentum=True)
    with pytest.raises(ValueError, match="orthogonalize_momentum must be True or False"):
        setup("mlp", orthogonalize="newton-schulz", orthogonalize_momentum="nesterov")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the CPU case runs the same code eagerly)"))])
def test_replays_as_cuda_graphs(device: str) -> None:
    """``T = 3``, 7 steps with ``cuda_graph=True`` equal ``cuda_graph=False`` (CPU: bit for
    bit; CUDA: the reuse steps replay, to float32 rounding); the momentum is static state."""
    assert_graphs_match_eager(device, orthogonalize="newton-schulz", orthogonalize_momentum=True,
                              curvature_every=3, lr=0.02, momentum=MU)

