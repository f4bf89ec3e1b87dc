"""``TENGraD.curvature_spectrum()``: each layer's Fisher eigenvalues on the rows' span
against its damping, checked in float64 against ``eig(J Jᵀ)/m`` with ``J`` from
``vmap(grad)`` (``testing.oracle``) on fresh random batches of the MLP."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from testing.oracle import explicit_jacobian, per_sample_grads_reference
from testing.tengrad_step import batch, forward_backward, layer_params, setup, snapshot

M = 8


def _reference(ref_model, prepared, x, y, alphas) -> dict[str, dict[str, float]]:
    psg = per_sample_grads_reference(ref_model, x, F.cross_entropy, y)
    out = {}
    for layer, names in layer_params(prepared).items():
        J = explicit_jacobian(psg, names[0], names[1] if len(names) > 1 else None)
        lam = torch.linalg.eigvalsh(J @ J.T / M).clamp_min(0)
        a = alphas(J)
        out[layer] = {"rows": M, "damping": a, "largest": float(lam[-1]), "mean": float(lam.mean()),
                      "above_damping": float((lam > a).double().mean())}
    return out


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize("seed", [3, 17])
def test_spectrum_matches_dense_jacobian(relative: bool, seed: int) -> None:
    alpha = 0.5 if relative else 0.05
    template, model, opt = setup("mlp", damping=alpha, relative_damping=relative)
    assert opt.curvature_spectrum() == {}  # nothing cached yet
    x, y = batch("mlp", M, seed)
    before = snapshot(template, model)
    forward_backward(model, opt, x, y)
    opt.step()

    def alphas(J: torch.Tensor) -> float:  # relative: α·tr(JJᵀ)/m²
        return alpha * float((J * J).sum()) / M ** 2 if relative else alpha

    want = _reference(before, model, x, y, alphas)
    got = opt.curvature_spectrum()
    assert set(got) == set(want)
    for layer, ref in want.items():
        assert got[layer]["rows"] == ref["rows"]
        assert got[layer]["above_damping"] == ref["above_damping"], layer
        for key in ("damping", "largest", "mean"):
            assert got[layer][key] == pytest.approx(ref[key], rel=1e-9), (layer, key)
    if relative:  # α_l is the mean eigenvalue times α: some eigenvalues lie above it, some below
        assert all(0.0 < s["above_damping"] < 1.0 for s in got.values())
