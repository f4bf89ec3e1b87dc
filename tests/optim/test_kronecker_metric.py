"""``TENGraD(..., metric="kronecker")``: ``u = (F + αD)⁻¹ g`` with ``D = D_L ⊗ D_R`` full.

Exactness in float64 against a dense solve with ``D`` built here from the gradients' history,
independently of ``optim.tengrad.kronecker_metric``: EMAs of ``g gᵀ`` and ``gᵀ g``, their
square roots by SVD with the singular values floored at ``FLOOR`` of the largest, each
normalized to mean eigenvalue 1, ``D = torch.kron(D_L, D_R)`` (a vocabulary side, or one
longer than ``MAX_FULL_SIDE``: the diagonal of ``g gᵀ``), the bias the output side's. On an
MLP (``T = 1``, ``T = 3``, and with diagonal sides), and a small language model with an
embedding tied to the output Linear (with a bias) or not, and Hugging Face's ``Conv1D``.
A reference with ``D``'s diagonal in place of ``D`` misses; a resumed run continues bit for
bit; the CUDA-graph runner equals eager; reuse steps read nothing back from the device.
"""
from __future__ import annotations

import copy
import warnings
from typing import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad import kronecker_metric
from tengrad_fx.optim.tengrad.kronecker_metric import FLOOR
from tengrad_fx.optim.tengrad.metric import ROOT_EVERY, Metric
from tengrad_fx.utils.dispatch import SyncCounter
from testing.oracle import dense_layer_updates
from testing.tengrad_step import (
    assert_graphs_match_eager, assert_matches, batch, covered_and_biases, forward_backward, lm_loss, lm_steps,
    recorded_step, rel, setup, step_delta,
)

BETA2 = 0.9
ALPHA = 0.5  # with 0.05, the floored D makes the dense reference itself ill-conditioned (cond ~1e13)


def _side(moment: torch.Tensor) -> torch.Tensor:
    """``M^{1/2}`` normalized to mean eigenvalue 1, floored at ``FLOOR`` of its largest
    (by SVD; a diagonal ``M [n]`` elementwise), as a matrix."""
    if moment.ndim == 1:
        root = moment.sqrt()
        root = root.clamp(min=FLOOR * root.max())
        return torch.diag(root / root.mean())
    u, sv, _ = torch.linalg.svd(moment)
    root = sv.sqrt().clamp(min=FLOOR * sv[0].sqrt())
    return (u * (root / root.mean())) @ u.T


def _kronecker_metric(history: dict[str, list[torch.Tensor]], biases: dict[str, str], out_rows: dict[str, bool],
                      diagonal: dict[str, tuple[bool, bool]]) -> dict[str, torch.Tensor]:
    """``{param name: D's block}`` from each weight's gradients so far (EMA from zero, factor
    ``BETA2``); ``diagonal[name]``: whether its rows' / columns' side keeps a diagonal."""
    out = {}
    for name, grads in history.items():
        if grads[0].ndim != 2:
            continue
        diag_rows, diag_cols = diagonal.get(name, (False, False))
        L = R = torch.zeros(())
        for g in grads:
            L = BETA2 * L + (1 - BETA2) * ((g * g).sum(1) if diag_rows else g @ g.T)
            R = BETA2 * R + (1 - BETA2) * ((g * g).sum(0) if diag_cols else g.T @ g)
        D_L, D_R = _side(L), _side(R)
        out[name] = torch.kron(D_L, D_R)
        if name in biases:
            out[biases[name]] = D_L if out_rows[name] else D_R
    return out


def _roots_due(t: int, every: int, root_every: int | None) -> bool:
    """Whether step ``t`` recomputes ``D`` (a curvature step, or ``root_every`` steps after one)."""
    return t % every == 0 or (root_every is not None and (t % every) % root_every == 0)


@pytest.mark.parametrize("every,max_side,root_every", [(1, None, None), (3, None, None), (1, 12, None),
                                                       (4, None, 1), (5, None, 2), (4, 12, 1)])
def test_mlp_step_equals_dense_solve(every: int, max_side: int | None, root_every: int | None,
                                     monkeypatch) -> None:
    """Five steps of the MLP (6→16→12→4): each update is ``solve(JᵀJ/m + αD, g)`` with ``J``
    of the last curvature step, ``D`` of the last curvature step or recomputation of ``S``
    (``root_every``) and ``g`` of this one. ``max_side = 12``: the 16-wide sides keep a
    diagonal factor, the others a full one."""
    if max_side is not None:
        monkeypatch.setattr(kronecker_metric, "MAX_FULL_SIDE", max_side)
    template, model, opt = setup("mlp", metric=Metric("kronecker", BETA2, root_every), curvature_every=every,
                                 lr=0.02, damping=ALPHA)
    covered, biases = covered_and_biases(model)
    limit = max_side or 10 ** 9
    diagonal = {n: (p.shape[0] > limit, p.shape[1] > limit) for n, p in model.named_parameters() if p.ndim == 2}
    assert max_side is None or any(any(d) for d in diagonal.values())
    history: dict[str, list[torch.Tensor]] = {}
    for t in range(5):
        ref_model, x, y, g = recorded_step(template, model, opt, t, history)
        if _roots_due(t, every, root_every):
            D = _kronecker_metric(history, biases, {n: True for n in biases}, diagonal)
        if t % every == 0:
            curv = (ref_model, x, y)
        ref = dense_layer_updates(*curv, F.cross_entropy, g, ALPHA, covered, metric=D)
        assert_matches(step_delta(model, opt), ref)


@pytest.mark.parametrize("strategy", ["factor", "materialize"])
@pytest.mark.parametrize("tied", [True, False])
def test_language_model_with_embedding_and_conv1d(tied: bool, strategy: str) -> None:
    """:class:`TinyLM`: the table ``[7, 5]`` gets a diagonal vocabulary side and a full
    ``5 × 5`` one (tied: also the head's bias, the vocabulary side); the transposed Linear
    ``[d_in, d_out]`` full sides, its bias the columns' (``d_out``); untied, the head
    ``[7, 5]`` full sides, its bias the rows'. Records kept as inputs and output gradients
    (``factor``) or as per-sample gradients (``materialize``)."""
    pytest.importorskip("transformers")
    biases = {"emb.weight": "head.bias", "mix.weight": "mix.bias"} if tied else \
        {"head.weight": "head.bias", "mix.weight": "mix.bias"}
    out_rows = {"emb.weight": True, "head.weight": True, "mix.weight": False}
    steps = lm_steps(3, tied, damping=ALPHA, metric=Metric("kronecker", BETA2), strategy=strategy)
    for ref_model, x, y, g, delta, history, covered in steps:
        assert {"emb.weight", "mix.weight", "head.bias"} <= set(covered)
        D = _kronecker_metric(history, biases, out_rows, {"emb.weight": (True, False)})
        assert_matches(delta, dense_layer_updates(ref_model, x, y, lm_loss, g, ALPHA, covered, metric=D))


def _norm_metric(history: dict[str, list[torch.Tensor]], names: list[str]) -> dict[str, torch.Tensor]:
    """``{param name: D's block}`` of norm parameters: ``_side`` of the EMA of ``g²``."""
    out = {}
    for name in names:
        M = torch.zeros(())
        for g in history[name]:
            M = BETA2 * M + (1 - BETA2) * g.square().flatten()
        out[name] = _side(M)
    return out


@pytest.mark.parametrize("strategy", ["factor", "materialize"])
def test_norm_layers_get_diagonal_factors(strategy: str) -> None:
    """An MLP with a ``LayerNorm`` (``γ``, ``β``) and an ``RMSNorm`` (``γ`` only), ``T = 3``,
    ``root_every = 2``: each update is the dense solve with a diagonal ``D`` of each norm
    parameter from its ``g²`` (and the Linear weights' Kronecker ``D``); records kept as
    ``x̂``, ``G`` (``factor``) or per-sample gradients (``materialize``). The reference with
    ``D = I`` on the norms misses them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 12), nn.RMSNorm(12),
                        nn.Tanh(), nn.Linear(12, 4)).double()
    with torch.no_grad():  # γ, β away from their initial values, so their gradients differ per entry
        for mod in (net[1], net[4]):
            mod.weight.uniform_(0.5, 1.5)
        net[1].bias.normal_()
    template = copy.deepcopy(net)
    model = tengrad_fx.prepare(net, example_inputs=(batch("mlp", 2, 99)[0],))
    opt = TENGraD(model, lr=0.02, damping=ALPHA, momentum=0.0, weight_decay=0.0, kl_clip=None, curvature_every=3,
                  metric=Metric("kronecker", BETA2, root_every=2), strategy=strategy)
    covered, biases = covered_and_biases(model)
    norms = ["1.weight", "1.bias", "4.weight"]
    assert set(norms) <= set(covered)
    history: dict[str, list[torch.Tensor]] = {}
    for t in range(5):
        ref_model, x, y, g = recorded_step(template, model, opt, t, history)
        delta = step_delta(model, opt)
        if _roots_due(t, 3, 2):
            D = {**_kronecker_metric(history, biases, {n: True for n in biases}, {}), **_norm_metric(history, norms)}
        if t % 3 == 0:
            curv = (ref_model, x, y)
        assert_matches(delta, dense_layer_updates(*curv, F.cross_entropy, g, ALPHA, covered, metric=D))
        plain = {n: d for n, d in D.items() if n not in norms}
        ref = dense_layer_updates(*curv, F.cross_entropy, g, ALPHA, covered, metric=plain)
        assert min(rel(delta[n], ref[n]) for n in norms) > 1e-3


@pytest.mark.parametrize("strategy", ["factor", "materialize"])
@pytest.mark.parametrize("tied", [True, False])
def test_language_model_after_recomputed_roots(tied: bool, strategy: str) -> None:
    """:class:`TinyLM` with ``T = 3``, ``root_every = 1``: on the reuse steps the update is the
    dense solve with the curvature step's ``J`` and the ``D`` of this step's moments (the
    embedding's diagonal vocabulary side, the tied head's bias, ``Conv1D``'s transposed sides);
    the curvature step's ``D`` misses by far more than the tolerance."""
    pytest.importorskip("transformers")
    biases = {"emb.weight": "head.bias", "mix.weight": "mix.bias"} if tied else \
        {"head.weight": "head.bias", "mix.weight": "mix.bias"}
    out_rows = {"emb.weight": True, "head.weight": True, "mix.weight": False}
    steps = lm_steps(3, tied, damping=ALPHA, metric=Metric("kronecker", BETA2, root_every=1), strategy=strategy,
                     curvature_every=3)
    for t, (ref_model, x, y, g, delta, history, covered) in enumerate(steps):
        D = _kronecker_metric(history, biases, out_rows, {"emb.weight": (True, False)})
        if t == 0:
            curv, D_old = (ref_model, x, y), D
        assert_matches(delta, dense_layer_updates(*curv, lm_loss, g, ALPHA, covered, metric=D))
        if t > 0:
            stale = dense_layer_updates(*curv, lm_loss, g, ALPHA, covered, metric=D_old)
            assert max(rel(delta[n], stale[n]) for n in stale) > 1e-3


def _mlp_steps(steps: int, **opt_kw) -> Iterator[tuple[tuple, dict, dict, dict, dict]]:
    """``steps`` steps of the MLP (damping ``ALPHA``, ``opt_kw`` the other options): per step
    ``((reference model before it, x, y), g, the update, D of the moments so far, covered)``."""
    template, model, opt = setup("mlp", damping=ALPHA, **opt_kw)
    covered, biases = covered_and_biases(model)
    history: dict[str, list[torch.Tensor]] = {}
    for t in range(steps):
        ref_model, x, y, g = recorded_step(template, model, opt, t, history)
        delta = step_delta(model, opt)
        yield (ref_model, x, y), g, delta, _kronecker_metric(history, biases, {n: True for n in biases}, {}), covered


def test_stale_metric_is_not_the_update_after_recomputed_roots() -> None:
    """``T = 4``, ``root_every = 2``: on step 2 the reference with the curvature step's ``D``
    misses; on step 1 (no recomputation) it is the update, and the recomputed ``D`` misses."""
    steps = _mlp_steps(3, metric=Metric("kronecker", BETA2, root_every=2), curvature_every=4, lr=0.02)
    for t, (now, g, delta, D_now, covered) in enumerate(steps):
        if t == 0:
            curv, D_curv = now, D_now
        right, wrong = (D_curv, D_now) if t == 1 else (D_now, D_curv)
        assert_matches(delta, dense_layer_updates(*curv, F.cross_entropy, g, ALPHA, covered, metric=right))
        if t > 0:
            ref = dense_layer_updates(*curv, F.cross_entropy, g, ALPHA, covered, metric=wrong)
            assert max(rel(delta[n], ref[n]) for n in ref) > 1e-3


def test_diagonal_of_the_metric_is_not_the_update() -> None:
    """The reference with ``D``'s diagonal (or ``D = I``) misses the update by far more than
    the tolerance: the test sees the off-diagonal factors."""
    *_, (curv, g, delta, D, covered) = _mlp_steps(2, metric=Metric("kronecker", BETA2))
    ref_model, x, y = curv
    assert_matches(delta, dense_layer_updates(ref_model, x, y, F.cross_entropy, g, ALPHA, covered, metric=D))
    diag = {n: d.diagonal().reshape(g[n].shape) for n, d in D.items()}
    for wrong in (diag, {}):
        ref = dense_layer_updates(ref_model, x, y, F.cross_entropy, g, ALPHA, covered, metric=wrong)
        assert max(rel(delta[n], ref[n]) for n in ref) > 1e-2


@pytest.mark.parametrize("stop,root_every", [(1, None), (3, None), (2, 2), (3, 2), (5, 2)])
def test_kronecker_metric_resumes_bit_for_bit(stop: int, root_every: int | None) -> None:
    """``T = 3`` (``root_every = 2``: ``T = 5``), saved before a reuse step, a curvature step,
    or (``root_every = 2``) before a recomputation of ``S`` (2) or just after one (3, 5): the
    loaded optimizer's next steps equal the uninterrupted run's bit for bit (``L``, ``R``,
    ``S`` and the scaled records travel in the state)."""
    kw = dict(metric=Metric("kronecker", root_every=root_every), curvature_every=3 if root_every is None else 5,
              momentum=0.9, lr=0.1)

    def run(stop: int | None) -> dict[str, torch.Tensor]:
        _, model, opt = setup("mlp", **kw)
        for t in range(8):
            if t == stop:
                sd, params = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
                _, model, opt = setup("mlp", **kw)
                model.load_state_dict(params)
                opt.load_state_dict(sd)
            x, y = batch("mlp", 8, t)
            forward_backward(model, opt, x, y)
            opt.step()
        state = opt.state[model.get_parameter("0.weight")]
        assert {"metric_L", "metric_R", "metric_scale_L", "metric_scale_R"} <= set(state)
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    whole, resumed = run(None), run(stop)
    assert all(torch.equal(whole[n], resumed[n]) for n in whole)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (the CPU case runs the same code eagerly)"))])
@pytest.mark.parametrize("root_every", [None, 2])
def test_kronecker_metric_replays_as_cuda_graphs(device: str, root_every: int | None) -> None:
    """``T = 3`` (``root_every = 2``: ``T = 5``), 7 steps with ``cuda_graph=True`` equal
    ``cuda_graph=False`` (CPU: bit for bit; CUDA: the reuse steps replay, to float32
    rounding): ``L``, ``R``, ``S``, the rebuilt stacks and factors are read from and written to
    static storage."""
    assert_graphs_match_eager(device, metric=Metric("kronecker", root_every=root_every), relative_damping=True,
                              curvature_every=3 if root_every is None else 5, lr=0.02, damping=1.0, momentum=0.9)


@pytest.mark.parametrize("root_every", [None, 2])
def test_reuse_steps_read_nothing_back(root_every: int | None) -> None:
    """float32, ``T = 3`` (``root_every = 2``: ``T = 5``): a warmed-up reuse step has no host
    sync; a curvature step's (or recomputation of ``S``'s) only reads are the eigensolver's,
    one per distinct factor shape."""
    _, model, opt = setup("mlp", metric=Metric("kronecker", root_every=root_every),
                          curvature_every=3 if root_every is None else 5, momentum=0.9, kl_clip=1e-3)
    model.float()
    shapes = {s for p in model.parameters() if p.ndim == 2 for s in p.shape}
    for t in range(8):
        x, y = batch("mlp", 8, t)
        forward_backward(model, opt, x.float(), y)
        curvature = opt._is_curvature_step() or opt._roots_due(opt._sched)
        with SyncCounter() as sc:
            opt.step()
        if t >= 1:
            if curvature:
                assert set(sc.ops) <= {"aten._linalg_eigh.default"} and sc.count <= len(shapes), dict(sc.ops)
            else:
                assert sc.count == 0, dict(sc.ops)
    assert opt.counters == {"step": 8, "skipped": 0, "uncaptured": 0}


@pytest.mark.parametrize("metric", ["kronecker", "factored"])
def test_non_finite_gradient_leaves_the_moments(metric: str) -> None:
    """A NaN gradient skips its step and leaves the moments (``L``, ``R``; factored: the row
    and column means) as they were, so the run goes on with finite steps (NaN moments would
    give ``S = I`` from then on, or NaN steps)."""
    _, model, opt = setup("mlp", metric=metric, curvature_every=1, momentum=0.9)
    keys = opt.metric.MOMENTS
    for t in range(4):
        x, y = batch("mlp", 8, t)
        forward_backward(model, opt, x, y)
        st = opt.state[model.get_parameter("0.weight")]
        if t == 2:
            model.get_parameter("0.weight").grad.view(-1)[3] = float("nan")
            before = {k: st[k].clone() for k in keys}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        if t == 2:
            assert all(torch.equal(before[k], st[k]) for k in before)
    assert opt.counters["skipped"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bad_metric_names_the_valid_values() -> None:
    """An unknown metric is a ValueError listing the valid values; ``root_every`` defaults to
    the kind's (``"auto"``: every 5 steps for the Kronecker metric, never for the factored)."""
    with pytest.raises(ValueError, match="metric must be None, 'factored', 'kronecker', got 'kron'"):
        setup("mlp", metric="kron")
    assert Metric("kronecker").root_every == "auto"
    for kind, every in (("kronecker", 5), ("factored", None)):
        assert setup("mlp", metric=kind)[2].metric.root_every == ROOT_EVERY[kind] == every
        assert setup("mlp", metric=Metric(kind, root_every=None))[2].metric.root_every is None


def test_bfloat16_autocast_steps_run_and_the_metric_acts() -> None:
    """Under ``torch.autocast("cpu", bfloat16)`` (bfloat16 records, finalized to float32): the
    steps run finite, without a skip, and differ from the plain metric's."""
    deltas = []
    for metric in (None, "kronecker"):
        _, model, opt = setup("mlp", metric=metric, curvature_every=2, lr=0.01, damping=1.0)
        model.float()
        for t in range(3):
            x, y = batch("mlp", 8, t)
            with torch.autocast("cpu", torch.bfloat16):
                forward_backward(model, opt, x.float(), y)
            before = model.get_parameter("2.weight").detach().clone()
            opt.step()
        deltas.append(before - model.get_parameter("2.weight").detach())
        assert opt.counters["skipped"] == 0
        assert all(torch.isfinite(p).all() for p in model.parameters())
    assert rel(deltas[1], deltas[0]) > 1e-2
