"""``TENGraD(..., metric="factored")``: ``u = (F + αD)⁻¹ g`` with a Kronecker-diagonal ``D``;
``relative_damping``: each layer's ``α_l = α·tr(F_l)/m`` (with a metric, of ``D^{-1/2} F_l D^{-1/2}``).

Exactness in float64 against a dense solve with ``D`` built here from the gradients'
history (EMAs of the row and column means of ``g²``, ``a = √r/mean(√r)``, ``b = √c/mean(√c)``,
``D = a ⊗ b``, the bias ``a``'s output side), independently of ``optim.tengrad.metric``:
an MLP at ``T = 1`` and ``T = 3`` (reuse steps keep the curvature step's ``D`` and
Fisher), and a small language model with a tied embedding / output layer, a padding index
and a transposed Linear (Hugging Face's ``Conv1D``). A resumed run continues bit for bit.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad.metric import FLOOR, Metric
from testing.oracle import dense_layer_updates, per_sample_grads_reference
from testing.tengrad_step import (
    assert_graphs_match_eager, assert_matches, batch, covered_and_biases, forward_backward, lm_loss, lm_steps,
    recorded_step, rel, setup, step_delta,
)

BETA2 = 0.9


def _factor(moment: torch.Tensor) -> torch.Tensor:
    root = moment.sqrt()
    return (root / root.mean()).clamp_min(FLOOR)


def _metric(history: dict[str, list[torch.Tensor]], out_rows: dict[str, bool],
            biases: dict[str, str]) -> dict[str, torch.Tensor]:
    """``{param name: D}`` from each weight's gradients so far (EMA from zero, factor ``BETA2``)."""
    out = {}
    for name, grads in history.items():
        if grads[0].ndim != 2:
            continue
        r = c = torch.zeros(())
        for g in grads:
            r = BETA2 * r + (1 - BETA2) * g.square().mean(1)
            c = BETA2 * c + (1 - BETA2) * g.square().mean(0)
        a, b = _factor(r), _factor(c)
        out[name] = a[:, None] * b[None, :]
        if name in biases:
            out[biases[name]] = a if out_rows[name] else b
    return out


def _relative(model: nn.Module, x: torch.Tensor, y: torch.Tensor, covered: dict[str, str],
              D: dict[str, torch.Tensor], alpha: float) -> dict[str, float]:
    """``{param name: α_l}``, ``α_l = α·Σ_i ‖J_i D^{-1/2}‖²/m²`` over the layer's parameters."""
    psg = per_sample_grads_reference(model, x, F.cross_entropy, y)
    m = y.shape[0]
    total: dict[str, float] = {}
    for pn, lay in covered.items():
        d = D.get(pn, torch.ones_like(psg[pn][0]))
        total[lay] = total.get(lay, 0.0) + float((psg[pn].square() / d).sum())
    return {pn: alpha * total[lay] / m ** 2 for pn, lay in covered.items()}


@pytest.mark.parametrize("every,metric,relative,root_every", [
    (1, "factored", False, None), (3, "factored", False, None), (1, None, True, None), (3, "factored", True, None),
    (4, "factored", True, 1), (4, "factored", False, 2)])
def test_step_equals_dense_solve(every: int, metric: str | None, relative: bool, root_every: int | None) -> None:
    """Five steps of the MLP: each update is ``solve(JᵀJ/m + α_l D, g)`` with ``J`` of the last
    curvature step, ``D`` and ``α_l`` of it or of the last recomputation of ``S``
    (``root_every``), and ``g`` of this one (``α_l = α`` or, relative,
    ``α·tr(D^{-1/2} F_l D^{-1/2})/m``)."""
    template, model, opt = setup("mlp", metric=Metric(metric, BETA2, root_every) if metric else None,
                                 curvature_every=every, relative_damping=relative, lr=0.02)
    covered, biases = covered_and_biases(model)
    history: dict[str, list[torch.Tensor]] = {}
    for t in range(5):
        ref_model, x, y, g = recorded_step(template, model, opt, t, history)
        if t % every == 0:
            curv = (ref_model, x, y)
        if t % every == 0 or (root_every is not None and (t % every) % root_every == 0):
            D = _metric(history, {n: True for n in biases}, biases) if metric else {}
            alphas = _relative(*curv, covered, D, 0.05) if relative else None
        ref = {}
        for pn, lay in covered.items():  # per layer: its α_l
            alpha = alphas[pn] if alphas else 0.05
            names = {n: lay for n, layer in covered.items() if layer == lay}
            ref.update(dense_layer_updates(*curv, F.cross_entropy, g, alpha, names, metric=D))
        assert_matches(step_delta(model, opt), ref)


def test_factored_metric_on_a_tied_language_model() -> None:
    """Three steps of :class:`TinyLM` (``T = 1``): the tied table ``[7, 5]`` gets
    ``D = a ⊗ b`` over its rows (vocabulary) and columns, the head's bias ``a``, the
    transposed Linear ``[d_in, d_out]`` its bias the columns' ``b``."""
    pytest.importorskip("transformers")
    biases = {"emb.weight": "head.bias", "mix.weight": "mix.bias"}
    for ref_model, x, y, g, delta, history, covered in lm_steps(3, damping=0.05,
                                                                metric=Metric("factored", BETA2)):
        assert {"emb.weight", "mix.weight", "head.bias"} <= set(covered)
        D = _metric(history, {"emb.weight": True, "mix.weight": False}, biases)
        assert_matches(delta, dense_layer_updates(ref_model, x, y, lm_loss, g, 0.05, covered, metric=D))


def test_factored_metric_resumes_bit_for_bit() -> None:
    """``T = 3``, saved after a curvature step (the next reuses it): the loaded optimizer's
    next steps equal the uninterrupted run's bit for bit (the moments, ``S`` and the scaled
    records travel in the state)."""
    def run(stop: int | None) -> dict[str, torch.Tensor]:
        template, model, opt = setup("mlp", metric="factored", curvature_every=3, momentum=0.9, lr=0.1)
        for t in range(5):
            if t == stop:
                sd, params = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
                _, model, opt = setup("mlp", metric="factored", curvature_every=3, momentum=0.9, lr=0.1)
                model.load_state_dict(params)
                opt.load_state_dict(sd)
            x, y = batch("mlp", 8, t)
            forward_backward(model, opt, x, y)
            opt.step()
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    whole, resumed = run(None), run(1)
    assert all(torch.equal(whole[n], resumed[n]) for n in whole)


def test_recomputed_roots_leave_uncovered_stacked_layers() -> None:
    """Two equal ``LayerNorm`` s (no factored ``D``: their records stay pointed at one stack)
    with ``root_every = 1``, ``T = 4``: on the first reuse step (the same gradients) their
    updates equal those of ``root_every = None`` (each layer's block is its own), while a
    Linear's differ."""
    deltas = []
    for root_every in (None, 1):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.LayerNorm(16),
                            nn.Linear(16, 4)).double()
        model = tengrad_fx.prepare(net, example_inputs=(batch("mlp", 2, 99)[0],))
        opt = TENGraD(model, lr=0.02, damping=0.5, curvature_every=4, metric=Metric("factored", BETA2, root_every))
        for t in range(2):
            x, y = batch("mlp", 8, t)
            forward_backward(model, opt, x, y)
            delta = step_delta(model, opt)
        assert any(len(g.layers) == 2 and g.layers[0].kind == "layernorm" for g in opt.curvature.groups)
        deltas.append(delta)
    for n in ("1.weight", "1.bias", "3.weight", "3.bias"):
        torch.testing.assert_close(deltas[1][n], deltas[0][n], rtol=1e-12, atol=0.0)
    assert rel(deltas[1]["2.weight"], deltas[0]["2.weight"]) > 1e-3


def test_metric_changes_the_step_and_bad_values_are_named() -> None:
    """The metric is not the identity (the update differs from the plain step's on the
    same batch); an unknown metric or a ``beta2`` outside ``[0, 1)`` is a ValueError
    naming it."""
    deltas = []
    for metric in (None, "factored"):
        _, model, opt = setup("mlp", metric=metric)
        x, y = batch("mlp", 8, 0)
        forward_backward(model, opt, x, y)
        deltas.append(step_delta(model, opt))
    assert (deltas[0]["0.weight"] - deltas[1]["0.weight"]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="metric"):
        setup("mlp", metric="diagonal")
    with pytest.raises(ValueError, match="beta2"):
        setup("mlp", metric=Metric("factored", beta2=1.0))
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="root_every"):
            Metric("kronecker", root_every=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the CPU case runs the same code eagerly)"))])
def test_metric_and_relative_damping_replay_as_cuda_graphs(device: str) -> None:
    """``T = 3``, 7 steps with ``cuda_graph=True`` equal ``cuda_graph=False`` (on a CPU the
    graph runner runs eagerly: bit for bit; on CUDA the reuse steps replay, to float32
    rounding): the moments, ``S`` and the relative ``α_l`` are read from static storage."""
    assert_graphs_match_eager(device, metric="factored", relative_damping=True, curvature_every=3, lr=0.02,
                              momentum=0.9)
