"""TENGraD under ``torch.autocast`` (bf16 on CPU): the step against the fp32 run, and
the float32 curvature (records, Gram, Cholesky, update) against a float64 dense solve
from the run's own records.

Tolerance of the bf16-vs-fp32 comparison (documented in docs/usage.md): one step from the
same weights and batch; the bf16 update may differ from the fp32 one by the bf16
gradient's own error amplified a little by the solve. Measured on ``AllKinds`` (seeds
0-3, m = 16, α = 0.1): gradients 0.39-0.75 %, updates 0.55-0.83 % (relative 2-norm over
all parameters), at most 1.5x the gradient's; per tensor at most 5.2 %. Asserted:
update error ≤ 3x the gradient error and ≤ 2 % over all parameters, ≤ 10 % per tensor.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import covered_layers, get_info

from testing.all_kinds import AllKinds, inputs

DAMPING = 0.1


def _cat(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.flatten() for v in d.values()])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _one_step(net: torch.nn.Module, x: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, low: bool,
              **kw: object) -> tuple[torch.nn.Module, tengrad_fx.TENGraD, dict, dict]:
    """Prepare a copy, one TENGraD step (lr 1, no momentum, curvature now, no clip);
    returns the model, the optimizer, the gradients and the updates ``w_before - w_after``."""
    pm = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=(x, idx))
    opt = tengrad_fx.TENGraD(pm, lr=1.0, damping=DAMPING, curvature_every=1, kl_clip=None, momentum=0.0, **kw)
    with torch.autocast("cpu", torch.bfloat16, enabled=low):
        out = pm(x, idx)
    F.cross_entropy(out.float(), y).backward()
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt.step()
    return pm, opt, grads, {n: before[n] - p.detach() for n, p in pm.named_parameters()}


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_step_matches_fp32_step(seed: int) -> None:
    torch.manual_seed(seed)
    net = AllKinds()
    x, idx = inputs(16, seed)
    y = torch.randint(0, 5, (16,))
    _, _, g32, u32 = _one_step(net, x, idx, y, low=False)
    _, _, g16, u16 = _one_step(net, x, idx, y, low=True)
    g_err, u_err = _rel(_cat(g16), _cat(g32)), _rel(_cat(u16), _cat(u32))
    assert 0 < g_err < 2e-2  # bf16 did run (the gradients differ)
    assert u_err <= min(3 * g_err, 2e-2), (u_err, g_err)
    for n in u32:
        assert _rel(u16[n], u32[n]) <= 0.1, n


def test_bf16_curvature_is_float32_and_exact_for_its_records() -> None:
    """After a bf16 step: records, Grams, Cholesky factors, momentum and parameters are
    float32, and the update equals ``(JᵀJ/m + αI)⁻¹ g`` in float64 from the run's own
    records ``J`` and gradient ``g`` to float32 accuracy (a bf16 solve would be ~1e-2)."""
    torch.manual_seed(0)
    net = AllKinds()
    x, idx = inputs(16)
    y = torch.randint(0, 5, (16,))
    pm, opt, grads, upd = _one_step(net, x, idx, y, low=True, update_form="woodbury")
    store = get_info(pm).store
    for recs in store.records.values():
        for r in recs:
            for t in (r.I, r.G, r.P, r.Gsum):
                assert t is None or not t.is_floating_point() or t.dtype == torch.float32
    assert opt.curvature.chol is not None and opt.curvature.chol.dtype == torch.float32
    assert all(K.dtype == torch.float32 for K in opt.curvature.K)
    names = {id(p): n for n, p in pm.named_parameters()}
    layers = covered_layers(pm)
    assert len(layers) == 11  # pos token included
    for layer in layers:
        J = layer.jacobian().double()
        ps = [p for p in (layer.weight, layer.bias) if p is not None]
        g = torch.cat([grads[names[id(p)]].flatten() for p in ps]).double()
        u = torch.cat([upd[names[id(p)]].flatten() for p in ps]).double()
        m, n = J.shape
        ref = torch.linalg.solve(J.T @ J / m + DAMPING * torch.eye(n, dtype=J.dtype), g)
        assert _rel(u, ref) <= 1e-4, (layer.name, _rel(u, ref))
    for p in pm.parameters():
        assert p.dtype == torch.float32


def test_records_can_stay_float32_with_solve_dtype() -> None:
    """``solve_dtype=torch.float64`` still works from bf16 records (factor in float64)."""
    torch.manual_seed(0)
    net = AllKinds()
    x, idx = inputs(8)
    y = torch.randint(0, 5, (8,))
    _, opt, _, upd = _one_step(net, x, idx, y, low=True, solve_dtype=torch.float64)
    assert opt.curvature.chol.dtype == torch.float64
    assert all(torch.isfinite(u).all() for u in upd.values())
