"""TENGraD's curvature schedule (warm-up, growing interval), grafting and orthogonalized updates.

The schedule: its interval rule on its own, and which steps of an optimizer take
curvature. Exactness in float64 against the dense references of ``testing.tengrad_step``:
a warm-up step is the dense block NGD step of its own batch, the first step after the
warm-up reuses the last batch's Fisher; a grafted step is the dense NGD update of each
parameter rescaled to the norm of SGD's, resp. RMSProp's direction (computed here from
the gradients, independently of ``tengrad_fx.optim.tengrad.graft``); an orthogonalized
step is that update's polar factor from ``torch.linalg.svd`` (``"newton-schulz"``: the SVD with
Muon's quintic applied to the singular values, ``testing.oracle.newton_schulz_reference``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tengrad_fx.optim import TENGraD
from tengrad_fx.optim.tengrad.graft import graft_updates, orthogonalize_updates
from tengrad_fx.optim.tengrad.schedule import CurvatureSchedule
from tengrad_fx.solve import POLAR_FLOOR, newton_schulz_polar
from tengrad_fx.utils.dispatch import OpCounter
from testing.oracle import newton_schulz_reference
from testing.tengrad_step import (
    assert_matches, batch, dense_u, forward_backward, full_grad, layer_params, recorded_step, setup, snapshot,
    step_delta,
)


def _curvature_steps(schedule: CurvatureSchedule, n: int) -> list[int]:
    out: list[int] = []
    for s in range(n):
        if schedule.due(s, out[-1] if out else 0, len(out)):
            out.append(s)
    return out


@pytest.mark.parametrize("kw,expect", [
    (dict(every=5), [0, 5, 10, 15]),
    (dict(every=5, warmup=3), [0, 1, 2, 7, 12, 17]),
    (dict(every=100, growth=2.0), [0, 2, 6, 14]),
    (dict(every=6, growth=2.0), [0, 2, 6, 12, 18]),
    (dict(every=100, warmup=2, growth=1.5), [0, 1, 3, 6, 11, 18]),
])
def test_schedule_rule(kw: dict, expect: list[int]) -> None:
    assert _curvature_steps(CurvatureSchedule(**kw), 20) == expect


def test_schedule_growth_saturates_without_overflow() -> None:
    s = CurvatureSchedule(every=100, growth=3.0)
    assert [s.interval(0, n) for n in (1, 2, 4, 5, 10_000)] == [3, 9, 81, 100, 100]


@pytest.mark.parametrize("kw,match", [(dict(warmup=-1), "curvature_warmup"), (dict(warmup=1.5), "curvature_warmup"),
                                      (dict(growth=1.0), "curvature_growth"), (dict(every=0), "curvature_every")])
def test_schedule_rejects(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CurvatureSchedule(**kw)


@pytest.mark.parametrize("kw,expect", [(dict(curvature_every=4, curvature_warmup=3), [0, 1, 2, 6]),
                                       (dict(curvature_every=100, curvature_growth=2.0), [0, 2, 6])])
def test_optimizer_follows_schedule(kw: dict, expect: list[int]) -> None:
    """The steps an optimizer takes curvature at: warm-up 3 then every 4; growth 2."""
    _, model, opt = setup("mlp", **kw)
    taken = []
    for t in range(9):
        x, y = batch("mlp", 4, t)
        before = opt.curvature_steps
        forward_backward(model, opt, x, y)
        opt.step()
        if opt.curvature_steps > before:
            taken.append(t)
    assert taken == expect


def test_warmup_steps_equal_dense_ngd() -> None:
    """Steps 0, 1 (warm-up 2): the dense NGD update of their own batch; step 2 reuses step 1's J."""
    template, model, opt = setup("mlp", curvature_every=100, curvature_warmup=2)
    layers = layer_params(model)
    batches = [batch("mlp", 8, s) for s in (1, 2, 3)]
    refs = []  # the model before each step: J of a reused Fisher is at its curvature step's weights
    for t, (x, y) in enumerate(batches):
        refs.append(snapshot(template, model))
        forward_backward(model, opt, x, y)
        g = full_grad(refs[t], x, y, F.cross_entropy)
        xj, yj = batches[min(t, 1)]
        ref = dense_u(refs[min(t, 1)], xj, yj, F.cross_entropy, g, 0.05, layers)
        assert_matches(step_delta(model, opt), ref)
    assert opt.curvature_steps == 2


def _rms_direction(gs: list[torch.Tensor], beta2: float = 0.999, eps: float = 1e-8) -> torch.Tensor:
    """RMSProp's ``g_t / (√v̂_t + ε)`` after the gradients ``gs`` (bias-corrected)."""
    t = len(gs)
    v = sum((1 - beta2) * beta2 ** (t - 1 - i) * g * g for i, g in enumerate(gs))
    return gs[-1] / ((v / (1 - beta2 ** t)).sqrt() + eps)


def _svd_polar(u: torch.Tensor) -> torch.Tensor:
    """``U diag(σ / max(σ, δσ₁)) Vᵀ`` of the thin SVD of ``u`` viewed ``[shape[0], -1]`` (a
    layer's update has rank ≤ the batch size), at RMS 0.2, in ``u``'s shape."""
    mat = u.reshape(u.shape[0], -1)
    left, sv, right = torch.linalg.svd(mat, full_matrices=False)
    q = left * (sv / sv.clamp(min=POLAR_FLOOR * sv[0])) @ right
    return (q * (0.2 * max(mat.shape) ** 0.5)).reshape(u.shape)


def _ns_polar(u: torch.Tensor) -> torch.Tensor:
    """Muon's five quintic steps on ``u`` viewed ``[shape[0], -1]`` (by the SVD), at RMS 0.2."""
    mat = u.reshape(u.shape[0], -1)
    return (newton_schulz_reference(mat) * (0.2 * max(mat.shape) ** 0.5)).reshape(u.shape)


@pytest.mark.parametrize("graft,orthogonalize", [("sgd", False), ("rmsprop", False), (None, True),
                                                  ("rmsprop", True), (None, "newton-schulz"),
                                                  ("rmsprop", "newton-schulz")])
def test_shaped_step_equals_dense_ngd_reference(graft, orthogonalize) -> None:
    """Two curvature steps, KL-clipped: per parameter ``u = û·‖a‖/‖û‖`` with grafting (``û``
    the dense NGD update, ``a`` SGD's / RMSProp's direction), then, orthogonalizing, each
    weight's ``u`` is the SVD polar factor at RMS 0.2 (1-D parameters keep theirs)."""
    template, model, opt = setup("mlp", graft=graft, orthogonalize=orthogonalize, kl_clip=0.5, lr=0.3)
    layers = layer_params(model)
    history: dict[str, list[torch.Tensor]] = {}
    for t in (1, 2):
        ref_model, x, y, g = recorded_step(template, model, opt, t, history)
        ref = dense_u(ref_model, x, y, F.cross_entropy, g, 0.05, layers)
        if graft is not None:
            a = {n: g[n] if graft == "sgd" else _rms_direction(history[n]) for n in ref}
            ref = {n: u * (a[n].norm() / u.norm()) for n, u in ref.items()}
        if orthogonalize:
            polar = _ns_polar if orthogonalize == "newton-schulz" else _svd_polar
            ref = {n: polar(u) if u.ndim >= 2 else u for n, u in ref.items()}
        ug = sum(float((ref[n] * g[n]).sum()) for n in ref)
        nu = min(1.0, (0.5 / (0.3 ** 2 * ug)) ** 0.5)  # the KL clip on the shaped update
        assert_matches(step_delta(model, opt), {n: nu * u for n, u in ref.items()})


def test_graft_covers_every_param_group() -> None:
    """Grafting rescales the parameters of every param group, not only the first's: one
    SGD-grafted step with the first layer in its own group is the dense NGD update with each
    parameter's norm set to its gradient's."""
    template, model, _ = setup("mlp")
    params = list(model.parameters())
    groups = [dict(params=params[:2]), dict(params=params[2:])]
    opt = TENGraD(model, lr=0.3, damping=0.05, momentum=0.0, weight_decay=0.0, curvature_every=1,
                  kl_clip=None, graft="sgd", params=groups)
    x, y = batch("mlp", 8, 1)
    ref_model = snapshot(template, model)
    forward_backward(model, opt, x, y)
    g = full_grad(ref_model, x, y, F.cross_entropy)
    ref = dense_u(ref_model, x, y, F.cross_entropy, g, 0.05, layer_params(model))
    assert_matches(step_delta(model, opt), {n: u * (g[n].norm() / u.norm()) for n, u in ref.items()})


def test_orthogonalized_weights_skip_the_graft() -> None:
    """Under ``orthogonalize`` a weight's grafted norm would be discarded by its polar factor:
    no RMSProp moment is kept (or computed) for the weights, only for the 1-D parameters."""
    _, model, opt = setup("mlp", graft="rmsprop", orthogonalize=True)
    forward_backward(model, opt, *batch("mlp", 8, 1))
    opt.step()
    kept = {p.ndim for p in model.parameters() if "graft_sq" in opt.state[p]}
    assert kept == {1}


def test_graft_rejects_unknown() -> None:
    with pytest.raises(ValueError, match="graft"):
        setup("mlp", graft="adam")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_orthogonalized_non_finite_gradient_skips_the_step(value: float) -> None:
    """A NaN / inf gradient under ``orthogonalize`` (and grafting): no error from the
    eigensolver, the step is skipped, every parameter keeps its bits."""
    _, model, opt = setup("mlp", graft="rmsprop", orthogonalize=True, kl_clip=0.5, lr=0.3, momentum=0.9)
    forward_backward(model, opt, *batch("mlp", 8, 1))
    opt.step()
    forward_backward(model, opt, *batch("mlp", 8, 2))
    next(model.parameters()).grad.view(-1)[2] = value
    bits = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.counters["skipped"] == 1
    assert all(torch.equal(b, p.detach()) for b, p in zip(bits, model.parameters()))
    forward_backward(model, opt, *batch("mlp", 8, 3))  # the next finite step trains again
    opt.step()
    assert opt.counters["skipped"] == 1
    assert all(p.isfinite().all() and not torch.equal(b, p.detach()) for b, p in zip(bits, model.parameters()))


def test_orthogonalize_refuses_cuda_graphs() -> None:
    """The polar factor's eigendecomposition cannot be captured in a CUDA graph: asking for
    both is an error naming them; by default ``orthogonalize`` turns the graphs off."""
    with pytest.raises(ValueError, match="orthogonalize=True, cuda_graph=True"):
        setup("mlp", orthogonalize=True, cuda_graph=True)
    assert setup("mlp", orthogonalize=True)[2].cuda_graph is False


def test_newton_schulz_allows_cuda_graphs_and_bad_values_are_named() -> None:
    """Newton–Schulz has no host read: ``cuda_graph=True`` is accepted with it; a method that
    does not exist is a ValueError naming ``orthogonalize``."""
    opt = setup("mlp", orthogonalize="newton-schulz", cuda_graph=True)[2]
    assert opt.cuda_graph is True and opt.orthogonalize == "newton-schulz"
    assert setup("mlp", orthogonalize=True)[2].orthogonalize == "eigh"
    with pytest.raises(ValueError, match="orthogonalize must be"):
        setup("mlp", orthogonalize="svd")



@pytest.mark.parametrize("graft", ["sgd", "rmsprop"])
def test_graft_launches_the_same_ops_for_any_number_of_parameters(graft: str) -> None:
    """``graft_updates`` runs ``_foreach`` ops over all parameters: 3 parameters and 12
    dispatch the same ops (a per-parameter loop would grow with them), and a step with a
    non-finite gradient leaves every RMSProp moment and count bit for bit."""
    gen = torch.Generator().manual_seed(0)

    def run(n: int, bad: bool = False) -> tuple[OpCounter, list[dict], dict]:
        ps = [torch.randn(4, 3, generator=gen) if i % 2 else torch.randn(5, generator=gen) for i in range(n)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        updates = {p: torch.randn(p.shape, generator=gen) for p in ps[::2]}
        state: dict = {p: {} for p in ps}
        graft_updates(updates, ps, state, graft)  # moments exist
        before = [{k: v.clone() for k, v in state[p].items()} for p in ps]
        if bad:
            ps[-1].grad[0] = float("nan")
        with OpCounter() as oc:
            graft_updates(updates, ps, state, graft)
        return oc, before, state

    few, many = run(3)[0], run(12)[0]
    assert few.ops == many.ops and few.kernels <= 30, (few.ops, many.ops)
    if graft == "rmsprop":
        _, before, state = run(4, bad=True)
        after = list(state.values())
        assert all(torch.equal(b[k], a[k]) for b, a in zip(before, after) for k in ("graft_sq", "graft_t"))


def test_newton_schulz_takes_equal_shapes_as_one_batch() -> None:
    """``orthogonalize="newton-schulz"``: three weights of one shape launch the matrix products
    of one (a batch), and each gets its own factor (float64, against one at a time); a weight
    of another shape, and a 1-D parameter, are not batched with them."""
    gen = torch.Generator().manual_seed(4)
    ws = [torch.zeros(8, 2, 5, dtype=torch.float64) for _ in range(3)] + [torch.zeros(6, 7, dtype=torch.float64)]
    bias = torch.zeros(8, dtype=torch.float64)
    updates = {p: torch.randn(p.shape, dtype=torch.float64, generator=gen) for p in ws + [bias]}
    products = ("aten.mm.default", "aten.addmm.default", "aten.baddbmm.default", "aten.bmm.default")

    def count(ups: dict) -> int:  # type: ignore[type-arg]
        with OpCounter() as oc:
            orthogonalize_updates(ups, "newton-schulz")
        return sum(oc.ops[k] for k in products)

    assert count({p: updates[p] for p in ws[:3]}) == count({ws[0]: updates[ws[0]]})
    out = orthogonalize_updates(updates, "newton-schulz")
    for p in ws:
        mat = updates[p].reshape(p.shape[0], -1)
        ref = newton_schulz_polar(mat, scale=0.2 * max(mat.shape) ** 0.5).reshape(p.shape)
        torch.testing.assert_close(out[p], ref, rtol=0, atol=1e-13)
    assert out[bias] is updates[bias]


def test_group_without_orthogonalize_keeps_its_ngd_update() -> None:
    """A param group with ``"orthogonalize": False`` (Muon's recipe for the output layer):
    its weight's update is the dense NGD update, the other weights' the SVD polar factor."""
    template, model, _ = setup("mlp")
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    head = names[-2:]  # the last Linear's weight and bias
    groups = [{"params": [params[n] for n in names if n not in head]},
              {"params": [params[n] for n in head], "orthogonalize": False}]
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, weight_decay=0.0, curvature_every=1, kl_clip=None,
                  params=groups, orthogonalize=True)
    x, y = batch("mlp", 8, 1)
    ref_model = snapshot(template, model)
    forward_backward(model, opt, x, y)
    g = full_grad(ref_model, x, y, F.cross_entropy)
    ref = dense_u(ref_model, x, y, F.cross_entropy, g, 0.05, layer_params(model))
    want = {n: u if (n in head or u.ndim < 2) else _svd_polar(u) for n, u in ref.items()}
    assert_matches(step_delta(model, opt), want)


def test_group_orthogonalize_is_checked() -> None:
    _, model, _ = setup("mlp")
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['orthogonalize'\] is True"):
        TENGraD(model, lr=0.1, damping=0.1, params=[{"params": list(model.parameters()), "orthogonalize": True}])
    with pytest.raises(ValueError, match="must be True or False"):
        TENGraD(model, lr=0.1, damping=0.1, orthogonalize=True,
                params=[{"params": list(model.parameters()), "orthogonalize": "eigh"}])
