"""``TENGraD(curvature_samples=k)``: the Fisher of the first ``k`` samples, inverted exactly.

Reference (float64, ``testing.tengrad_step``): per covered layer ``u = solve(J_kᵀJ_k/k + αI, g)``
with ``J_k`` the ``vmap(grad)`` per-sample gradients of the first ``k`` samples' own losses
(at the weights of the curvature step) and ``g`` the whole batch's gradient (at the current
weights): on the curvature step and on a reuse step after it, for the empirical and the MC
Fisher (explicit sampled labels), the Gauss-Newton Fisher and the fused (``compile``) path.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.registry import make_optimizer
from testing import output_jacobians_reference
from testing.tengrad_step import (
    assert_matches, batch, dense_u, forward_backward, full_grad, layer_params, setup, snapshot, step_delta,
)

M, K, ALPHA = 8, 3, 0.05


def _records(model: nn.Module) -> list:
    return [r for recs in tengrad_fx.get_info(model).store.records.values() for r in recs]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("kl_clip", [None, 0.5])
def test_curvature_and_reuse_steps_equal_subsampled_dense_ngd(kind: str, kl_clip) -> None:
    """Step 1 takes curvature from its batch's first k samples; step 2 reuses them with its
    own batch's gradient. KL-clipped: ``ν = min(1, sqrt(κ / (lr²·Σ u·g)))`` of the reference."""
    lr = 1.0 if kl_clip is None else 0.3
    template, model, opt = setup(kind, curvature_every=100, curvature_samples=K, kl_clip=kl_clip, lr=lr)
    layers = layer_params(model)
    (x1, y1), (x2, y2) = batch(kind, M, 1), batch(kind, M, 2)
    ref1 = snapshot(template, model)
    for x, y in ((x1, y1), (x2, y2)):
        ref_now = snapshot(template, model)
        forward_backward(model, opt, x, y)
        g = full_grad(ref_now, x, y, F.cross_entropy)
        ref = dense_u(ref1, x1[:K], y1[:K], F.cross_entropy, g, ALPHA, layers)
        if kl_clip is not None:
            ug = sum(float((ref[n] * g[n]).sum()) for n in ref)
            ref = {n: min(1.0, (kl_clip / (lr ** 2 * ug)) ** 0.5) * u for n, u in ref.items()}
        assert_matches(step_delta(model, opt), ref)
        recs = _records(model)  # what a reuse step's cost is proportional to: k rows per record
        assert recs and all(r.m == K and r.loss_batch == M for r in recs)
    assert opt.curvature_steps == 1


def test_mc_fisher_with_sampled_labels() -> None:
    """``fisher="mc"``: the curvature of the first k samples' sampled labels ``t``."""
    template, model, opt = setup("cnn", curvature_every=100, curvature_samples=K, fisher="mc")
    layers = layer_params(model)
    (x1, y1), (x2, y2) = batch("cnn", M, 1), batch("cnn", M, 2)
    t = torch.randint(0, 4, (M,), generator=torch.Generator().manual_seed(7))
    ref1 = snapshot(template, model)
    for x, y, mc in ((x1, y1, True), (x2, y2, False)):
        ref_now = snapshot(template, model)
        out = model(x)
        opt.zero_grad()
        if mc:
            opt.mc_capture(out, targets=t)
        F.cross_entropy(out, y).backward()
        g = full_grad(ref_now, x, y, F.cross_entropy)
        assert_matches(step_delta(model, opt), dense_u(ref1, x1[:K], t[:K], F.cross_entropy, g, ALPHA, layers))
    assert opt.curvature_steps == 1


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - y).pow(2).sum(1).mean()


def test_gauss_newton_fisher_of_the_first_samples() -> None:
    """``fisher="gauss-newton"``: the GGN ``Σ_{i<k} J_iᵀJ_i / k`` (``J_i = ∂f(x_i)/∂θ``, all outputs)."""
    template, model, opt = setup("mlp", curvature_samples=K, fisher="gauss-newton")
    x, _ = batch("mlp", M, 1)
    y = torch.randn(M, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref_model = snapshot(template, model)
    out = model(x)
    opt.zero_grad()
    opt.mc_capture(out)
    _mse(out, y).backward()
    g = full_grad(ref_model, x, y, _mse)
    jac = output_jacobians_reference(ref_model, x[:K])
    ref = {}
    for names in layer_params(model).values():
        J = torch.cat([jac[n].flatten(2) for n in names], 2)  # [k, outputs, n]
        Fk = torch.einsum("ikp,ikq->pq", J, J) / K
        u = torch.linalg.solve(Fk + ALPHA * torch.eye(Fk.shape[0], dtype=Fk.dtype),
                               torch.cat([g[n].flatten() for n in names]))
        ref.update(zip(names, (v.view_as(g[n]) for n, v in zip(names, u.split([g[n].numel() for n in names])))))
    assert_matches(step_delta(model, opt), ref)
    assert all(r.m == 4 * K and r.loss_batch == 4 * M for r in _records(model))


def _train(kind: str, steps: int, **kw) -> list[torch.Tensor]:
    _, model, opt = setup(kind, curvature_every=2, **kw)
    for s in range(steps):
        forward_backward(model, opt, *batch(kind, M, s))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b))


def test_k_at_least_the_batch_is_the_default_bit_for_bit() -> None:
    ref = _train("cnn", 3)
    assert _equal(_train("cnn", 3, curvature_samples=M), ref)
    assert _equal(_train("cnn", 3, curvature_samples=10 * M), ref)
    assert not _equal(_train("cnn", 3, curvature_samples=K), ref)


def test_fused_and_cuda_graph_paths_equal_the_modular_one() -> None:
    """``compile=True`` (the fused function run eagerly) and ``cuda_graph=True`` (eager on a CPU,
    static buffers and refills as on CUDA) give the modular path's steps."""
    ref, start = _train("mlp", 4, curvature_samples=K), _train("mlp", 0)
    _, model, opt = setup("mlp", curvature_every=2, curvature_samples=K, compile=True)
    opt._fused.fn = None
    for s in range(4):
        forward_backward(model, opt, *batch("mlp", M, s))
        opt.step()
        assert (opt.curvature.chol is None) == (s % 2 == 0)  # curvature steps took the fused path
    got = [p.detach() for p in model.parameters()]
    assert max(((p - q).norm() / (q - p0).norm()).item() for p, q, p0 in zip(got, ref, start)) < 1e-10
    assert _equal(_train("mlp", 4, curvature_samples=K, cuda_graph=True), ref)


def test_state_dict_round_trip_is_bit_identical() -> None:
    """Saved after a subsampled curvature step (k-row records, the loss's batch kept), a
    resumed optimizer's reuse step equals the uninterrupted one."""
    template, model, opt = setup("cnn", curvature_every=100, curvature_samples=K)
    forward_backward(model, opt, *batch("cnn", M, 1))
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    saved = [r for per_site in sd["curvature"]["records"].values() for recs in per_site for r in recs]
    assert saved and all(r["batch"] == M and (r["I"] if r["I"] is not None else r["P"]).shape[0] == K
                         for r in saved)
    _, model2, opt2 = setup("cnn", curvature_every=100, curvature_samples=K)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    x, y = batch("cnn", M, 2)
    deltas = []
    for mdl, o in ((model, opt), (model2, opt2)):
        forward_backward(mdl, o, x, y)
        deltas.append(step_delta(mdl, o))
        assert o.curvature_steps == 1
    assert all(torch.equal(deltas[0][n], deltas[1][n]) for n in deltas[0])


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "32"])
def test_bad_k_is_refused(bad) -> None:
    _, model, _ = setup("mlp")
    with pytest.raises(ValueError, match="curvature_samples"):
        TENGraD(model, lr=0.1, damping=0.1, curvature_samples=bad)


def test_make_optimizer_passes_it_through() -> None:
    model = tengrad_fx.prepare(nn.Sequential(nn.Linear(6, 4)).double(), example_inputs=(torch.randn(2, 6).double(),))
    opt = make_optimizer("tengrad", model, "fashion-mnist", curvature_samples=32)
    assert opt.curvature_samples == 32


@pytest.mark.parametrize("part", [0, 1, 2])
def test_a_part_keeps_its_share_of_each_micro_batch(part: int) -> None:
    """Part ``part`` of 3, two accumulated micro-batches of 2 and 3 samples: the global batch
    is micro-batch 0 of every part, then micro-batch 1 of every part, and the part keeps the
    rows of its samples among the first ``k`` there (counted by enumerating the global
    positions), the first rows of its micro-batches' union."""
    model = tengrad_fx.prepare(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double())
    store = tengrad_fx.get_info(model).store
    xs = [torch.randn(n, 4, dtype=torch.float64) for n in (2, 3)]
    model.zero_grad(set_to_none=True)
    for x in xs:
        model(x).sum().backward()  # the gradients accumulate: the records join the union
    store.merge("mean")
    union = {site: [r.I.clone() for r in recs] for site, recs in store.records.items()}
    owner = [p for x in xs for p in range(3) for _ in range(len(x))]  # the part of each global position
    mine = [i for i, p in enumerate(owner) if p == part]
    whole = dict(store.records)
    for k in range(1, len(owner) + 1):
        store.records = dict(whole)  # keep_samples replaces each site's list
        store.keep_samples(k, part, 3)
        held = sum(1 for i in mine if i < k)
        for site, recs in store.records.items():
            assert [r.m for r in recs] == [held] * len(recs), (k, site)
            assert all(torch.equal(r.I, i[:held]) for r, i in zip(recs, union[site])), (k, site)


@pytest.mark.parametrize("micro", [(4,), (2, 3), (3, 1, 2)])
def test_global_samples_enumerate_the_micro_batch_major_batch(micro: tuple[int, ...]) -> None:
    """Each part's samples (its micro-batches' union, in order) at their positions in the
    global batch written out micro-batch by micro-batch, part by part; the shares of the
    first ``k`` counted from them (the position rows' and the first samples' one order)."""
    from tengrad_fx.capture.union import global_samples, union_samples_held
    parts = 3
    owner = [p for n in micro for p in range(parts) for _ in range(n)]  # global position -> its part
    for part in range(parts):
        want = [g for g, p in enumerate(owner) if p == part]
        got = global_samples(micro, part, parts)
        assert got.tolist() == want
        for k in range(len(owner) + 1):
            assert union_samples_held(k, micro, part, parts) == int((got < k).sum())
