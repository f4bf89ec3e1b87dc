"""``TENGraD`` against dense float64 references.

The reference update of a covered layer is ``u = solve(F + αI, g)`` with ``F = JᵀJ/m``,
``J`` built from ``testing.per_sample_grads_reference`` on an UNPREPARED copy of the model
(current parameters loaded into it) and ``g`` the full-batch gradient of that copy. The
optimizer's ``u`` is read off a step with ``lr=1, momentum=0, weight_decay=0``: the
parameter change is ``-u``.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from testing.tengrad_step import (
    TOL, LossFn, assert_matches, batch, dense_u, forward_backward, full_grad, layer_params, mc_labels, rel, setup,
    snapshot, step_delta,
)

# --------------------------------------------------------------------------- exact updates
STRATEGIES = [("auto", 1024.0), ("factor", 1024.0), ("materialize", 1024.0), ("materialize", 0.0)]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("strategy,budget", STRATEGIES, ids=["auto", "factor", "materialize", "materialize-nobudget"])
def test_update_equals_dense_reference(kind: str, strategy: str, budget: float, monkeypatch) -> None:
    """Two curvature steps (m=8, then m=6): the second one runs the backward that
    materializes per-sample gradients for layers the first step chose to keep ``J`` of."""
    from tengrad_fx.optim.tengrad.layer_groups import LayerGroup

    calls = {"push_through": 0, "woodbury": 0}
    real_probe = LayerGroup.probe

    def spy_probe(self, *a, **k):  # the form is picked per layer on the device by the probe
        ok = real_probe(self, *a, **k)
        calls["push_through"] += int(ok.sum())
        calls["woodbury"] += int((~ok).sum())
        return ok

    monkeypatch.setattr(LayerGroup, "probe", spy_probe)
    batches = [batch(kind, 8, 1), batch(kind, 6, 2)]
    deltas: dict[str, list[dict[str, torch.Tensor]]] = {}
    for form in ("auto", "woodbury"):
        calls.update(push_through=0, woodbury=0)
        template, model, opt = setup(kind, update_form=form, strategy=strategy, jacobian_budget_mb=budget)
        layers = layer_params(model)
        assert len(layers) == 3
        deltas[form] = []
        for t, (x, y) in enumerate(batches):
            ref_model = snapshot(template, model)
            forward_backward(model, opt, x, y)
            covered = tengrad_fx.covered_layers(model)
            if t == 0:  # layers whose J the optimizer keeps: materialized by the next backward
                expect = [budget > 0 and layer.choose(strategy) == "materialize" for layer in covered]
                if budget > 0 and (strategy == "materialize" or (strategy == "auto" and kind == "cnn")):
                    assert any(expect)
            else:
                assert [layer.materialized for layer in covered] == expect
            g = full_grad(ref_model, x, y, F.cross_entropy)
            for n, p in model.named_parameters():
                torch.testing.assert_close(p.grad, g[n], rtol=1e-10, atol=1e-13)
            ref = dense_u(ref_model, x, y, F.cross_entropy, g, 0.05, layers)
            deltas[form].append(step_delta(model, opt))
            assert_matches(deltas[form][-1], ref)
        # "auto" takes the push-through form on these (empirical, curvature) steps
        if form == "auto":
            assert calls["push_through"] > 0 and calls["woodbury"] == 0, calls
        else:  # no probe: the Woodbury form throughout
            assert calls == {"push_through": 0, "woodbury": 0}, calls
    for da, dw in zip(deltas["auto"], deltas["woodbury"]):
        for k in ref:
            assert rel(da[k], dw[k]) <= TOL


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_fused_update_equals_dense_reference(kind: str, monkeypatch) -> None:
    """``compile=True`` with the fused function run eagerly (no inductor build here; the
    compiled-vs-eager equality is tests/optim/test_compile.py's): T=2, steps on batches of
    8 (curvature, fused), 3 (reuse, modular path from the fused step's records) and 6
    (curvature, fused), both update forms."""
    import tengrad_fx.optim.tengrad.fused_runner as mod

    ran = [0]
    real = mod.fused_update

    def spy(*a, **k):
        ran[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(mod, "fused_update", spy)
    batches = [batch(kind, 8, 90), batch(kind, 3, 91), batch(kind, 6, 92)]
    for form in ("auto", "woodbury"):
        ran[0] = 0
        template, model, opt = setup(kind, update_form=form, curvature_every=2, compile=True)
        opt._fused.fn = None  # the fused function, eagerly
        layers = layer_params(model)
        J_at = None
        for t, (x, y) in enumerate(batches):
            ref = snapshot(template, model)
            if t % 2 == 0:
                J_at = (ref, x, y)
            forward_backward(model, opt, x, y)
            g = full_grad(ref, x, y, F.cross_entropy)
            assert_matches(step_delta(model, opt), dense_u(*J_at, F.cross_entropy, g, 0.05, layers))
        # curvature steps only (2 of the 3); cnn: the first may have no P yet (modular path)
        assert ran[0] == 2 if kind == "mlp" else 1 <= ran[0] <= 2, ran


def test_momentum_weight_decay_kl_clip_and_closure() -> None:
    """``d = ν·u + λw``, ``buf = μ·buf + d``, ``w ← w − lr·buf``, ``ν = min(1, sqrt(c/(lr²·Σu·g)))``."""
    lr, mu, wd, kl = 0.3, 0.9, 1e-2, 1e-4
    template, model, opt = setup("mlp", lr=lr, momentum=mu, weight_decay=wd, kl_clip=kl)
    layers = layer_params(model)
    buf: dict[str, torch.Tensor] = {}
    nus = []
    for t in range(3):
        x, y = batch("mlp", 8, 80 + t)
        ref = snapshot(template, model)
        g = full_grad(ref, x, y, F.cross_entropy)
        u = dense_u(ref, x, y, F.cross_entropy, g, 0.05, layers)
        vg = lr ** 2 * sum((u[k] * g[k]).sum() for k in u).item()
        nu = min(1.0, math.sqrt(kl / vg))
        nus.append(nu)
        w = {n: p.detach().clone() for n, p in model.named_parameters()}

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)  # noqa: B023
            loss.backward()
            return loss

        loss = opt.step(closure)
        assert loss is not None and torch.isclose(loss, F.cross_entropy(ref(x), y), rtol=1e-12)
        for n, p in model.named_parameters():
            d = nu * u[n] + wd * w[n]
            buf[n] = d if t == 0 else mu * buf[n] + d
            assert rel(w[n] - p.detach(), lr * buf[n]) <= TOL, (t, n)
    assert nus[0] < 1  # the clip is active in this setting


def test_fallback_parameters_get_plain_gradient() -> None:
    """A PReLU (not covered) is updated with ``u = g``; covered layers stay exact."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 10), nn.PReLU(10), nn.Tanh(), nn.Linear(10, 4)).double()
    template = copy.deepcopy(net)
    x, y = batch("mlp", 8, 3)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=1.0, damping=0.1, momentum=0.0, curvature_every=1, kl_clip=None)
    ref_model = snapshot(template, model)
    forward_backward(model, opt, x, y)
    g = full_grad(ref_model, x, y, F.cross_entropy)
    ref = dense_u(ref_model, x, y, F.cross_entropy, g, 0.1, layer_params(model))
    delta = step_delta(model, opt)
    assert_matches(delta, ref)
    for k in ("1.weight",):
        assert k not in ref
        torch.testing.assert_close(delta[k], g[k], rtol=1e-12, atol=1e-14)


def test_solve_dtype_float64_for_float32_model() -> None:
    template, model, _ = setup("mlp")
    model.float()
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, solve_dtype=torch.float64, curvature_every=1, kl_clip=None)
    x, y = batch("mlp", 8, 4)
    ref_model = snapshot(template, model).double()
    forward_backward(model, opt, x.float(), y)
    ref = dense_u(ref_model, x, y, F.cross_entropy, full_grad(ref_model, x, y, F.cross_entropy), 0.05,
                  layer_params(model))
    delta = step_delta(model, opt)
    assert all(d.dtype == torch.float32 for d in delta.values())
    assert_matches({k: v.double() for k, v in delta.items()}, ref, tol=1e-4)


def _mse_sum_half(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return 0.5 * (o - t).pow(2).reshape(o.shape[0], -1).sum(1).mean()


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("mc_loss", ["cross_entropy", "mse"])
def test_mc_fisher_equals_dense_reference(kind: str, mc_loss: str) -> None:
    template, model, opt = setup(kind, fisher="mc", mc_loss=mc_loss)
    x, y = batch(kind, 8, 5)
    ref_model = snapshot(template, model)
    out = model(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad()
    opt.seed_mc(1234)
    opt.mc_capture(out)
    loss.backward()
    # the sampled targets, reproduced with the same seed
    torch.manual_seed(1234)
    o = out.detach()
    if mc_loss == "cross_entropy":
        t = mc_labels(o, 1234)
        assert not torch.equal(t, y)  # the test would not tell MC from empirical otherwise
        lossJ: LossFn = F.cross_entropy
    else:
        t = o + torch.randn_like(o)
        lossJ = _mse_sum_half
    g = full_grad(ref_model, x, y, F.cross_entropy)  # g: true labels
    for n, p in model.named_parameters():  # the real backward produced the true-label gradient
        torch.testing.assert_close(p.grad, g[n], rtol=1e-12, atol=1e-14)
    ref = dense_u(ref_model, x, t, lossJ, g, 0.05, layer_params(model))
    assert_matches(step_delta(model, opt), ref)


# --------------------------------------------------------------------------- curvature reuse
def _record_ids(model: nn.Module) -> dict[int, list[int]]:
    store = tengrad_fx.get_info(model).store
    return {s: [id(r) for r in recs] for s, recs in store.records.items()}


def test_curvature_reuse_uses_stored_batch() -> None:
    template, model, opt = setup("mlp", curvature_every=3)
    store = tengrad_fx.get_info(model).store
    layers = layer_params(model)
    batches = [batch("mlp", 8, 10 + t) for t in range(5)]
    # step 0: capture
    x0, y0 = batches[0]
    ref0 = snapshot(template, model)
    forward_backward(model, opt, x0, y0)
    gen0, ids0 = store.generation, _record_ids(model)
    d0 = step_delta(model, opt)
    assert_matches(d0, dense_u(ref0, x0, y0, F.cross_entropy, full_grad(ref0, x0, y0, F.cross_entropy), 0.05, layers))
    # steps 1, 2: capture off, step-0 records reused; step 2 also changes the damping
    for t, damping in ((1, 0.05), (2, 0.2)):
        xt, yt = batches[t]
        opt.param_groups[0]["damping"] = damping
        ref_t = snapshot(template, model)
        forward_backward(model, opt, xt, yt)
        assert store.generation == gen0 and _record_ids(model) == ids0, "forward retained new tensors"
        g = full_grad(ref_t, xt, yt, F.cross_entropy)
        u_ref = dense_u(ref0, x0, y0, F.cross_entropy, g, damping, layers)  # J at step 0's params and batch
        assert_matches(step_delta(model, opt), u_ref)
    # step 3: captures again
    x3, y3 = batches[3]
    ref3 = snapshot(template, model)
    forward_backward(model, opt, x3, y3)
    assert store.generation == gen0 + 1
    g = full_grad(ref3, x3, y3, F.cross_entropy)
    assert_matches(step_delta(model, opt), dense_u(ref3, x3, y3, F.cross_entropy, g, 0.2, layers))
    assert opt.counters == {"step": 4, "skipped": 0, "uncaptured": 0}


def test_small_last_batch_with_reused_curvature() -> None:
    """T=2: curvature from m=8, then a step on a batch of 3 (the epoch's last batch)."""
    template, model, opt = setup("cnn", curvature_every=2)
    layers = layer_params(model)
    x0, y0 = batch("cnn", 8, 20)
    ref0 = snapshot(template, model)
    forward_backward(model, opt, x0, y0)
    opt.step()
    x1, y1 = batch("cnn", 3, 21)
    ref1 = snapshot(template, model)
    forward_backward(model, opt, x1, y1)
    g = full_grad(ref1, x1, y1, F.cross_entropy)
    assert_matches(step_delta(model, opt), dense_u(ref0, x0, y0, F.cross_entropy, g, 0.05, layers))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("form", ["auto", "woodbury"])
def test_batch_size_one(kind: str, form: str) -> None:
    template, model, opt = setup(kind, update_form=form)
    x, y = batch(kind, 1, 30)
    ref = snapshot(template, model)
    forward_backward(model, opt, x, y)
    u = dense_u(ref, x, y, F.cross_entropy, full_grad(ref, x, y, F.cross_entropy), 0.05, layer_params(model))
    assert_matches(step_delta(model, opt), u)


# --------------------------------------------------------------------------- state, schedules
