"""``TENGraD`` against dense float64 references.

The reference update of a covered layer is ``u = solve(F + αI, g)`` with ``F = JᵀJ/m``,
``J`` built from ``testing.per_sample_grads_reference`` on an UNPREPARED copy of the model
(current parameters loaded into it) and ``g`` the full-batch gradient of that copy. The
optimizer's ``u`` is read off a step with ``lr=1, momentum=0, weight_decay=0``: the
parameter change is ``-u``.
"""
from __future__ import annotations

import copy
import gzip
import io
import math
import os
import time
import warnings
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from testing import dense_layer_updates

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
TOL = 1e-8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# --------------------------------------------------------------------------- models / data
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)).double()


def cnn() -> nn.Module:
    """Conv, grouped conv (groups=2, stride 2, no bias), Linear; input ``[B, 3, 8, 8]``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
        nn.Conv2d(4, 4, 3, groups=2, stride=2, bias=False), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 4),
    ).double()


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (3, 8, 8))}


def batch(kind: str, m: int, seed: int, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, *MODELS[kind][1], generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (m,), generator=g)
    return x, y


def setup(kind: str, **opt_kw) -> tuple[nn.Module, nn.Module, TENGraD]:
    """(pristine unprepared template, prepared model, optimizer)."""
    net = MODELS[kind][0]()
    template = copy.deepcopy(net)
    x, _ = batch(kind, 2, 99)
    model = tengrad_fx.prepare(net, example_inputs=(x,))
    kw = dict(lr=1.0, damping=0.05, momentum=0.0, weight_decay=0.0, curvature_every=1, kl_clip=None)
    kw.update(opt_kw)
    return template, model, TENGraD(model, **kw)


def snapshot(template: nn.Module, model: nn.Module) -> nn.Module:
    """An unprepared copy holding ``model``'s current parameters."""
    ref = copy.deepcopy(template)
    ref.load_state_dict(model.state_dict())
    return ref


def layer_params(model: nn.Module) -> dict[str, list[str]]:
    """Covered layer name -> its parameter names (weight first)."""
    out: dict[str, list[str]] = {}
    for pn, layer in sorted(tengrad_fx.get_info(model).covered.items(), key=lambda kv: not kv[0].endswith("weight")):
        out.setdefault(layer, []).append(pn)
    return out


def full_grad(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> dict[str, torch.Tensor]:
    ref.zero_grad()
    loss_fn(ref(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def dense_u(J_ref: nn.Module, xJ: torch.Tensor, yJ: torch.Tensor, lossJ: LossFn, g: dict[str, torch.Tensor],
            damping: float, layers: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """``{param name: u}``, ``u = solve(JᵀJ/m + αI, g)`` per layer (``layers``: name -> params)."""
    covered = {pn: lay for lay, names in layers.items() for pn in names}
    return dense_layer_updates(J_ref, xJ, yJ, lossJ, g, damping, covered)


def step_delta(model: nn.Module, opt: TENGraD) -> dict[str, torch.Tensor]:
    """``{name: p_before - p_after}`` over one ``opt.step()``; with lr=1 that is ``u``."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {n: (before[n] - p.detach()) / opt.param_groups[0]["lr"] for n, p in model.named_parameters()}


def forward_backward(model: nn.Module, opt: TENGraD, x, y, loss_fn: LossFn = F.cross_entropy) -> torch.Tensor:
    out = model(x)
    loss = loss_fn(out, y)
    opt.zero_grad()
    loss.backward()
    return out


def assert_matches(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert ref, "no covered layer"
    for k, u_ref in ref.items():
        r = rel(delta[k], u_ref)
        assert r <= tol, f"{k}: rel err {r:.2e}"


# --------------------------------------------------------------------------- exact updates
STRATEGIES = [("auto", 1024.0), ("factor", 1024.0), ("materialize", 1024.0), ("materialize", 0.0)]


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("strategy,budget", STRATEGIES, ids=["auto", "factor", "materialize", "materialize-nobudget"])
def test_update_equals_dense_reference(kind: str, strategy: str, budget: float, monkeypatch) -> None:
    """Two curvature steps (m=8, then m=6): the second one runs the backward that
    materializes per-sample gradients for layers the first step chose to keep ``J`` of."""
    from tengrad_fx.optim.tengrad_groups import LayerGroup

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
    import tengrad_fx.optim.fused_step as mod

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
            loss = F.cross_entropy(model(x), y)
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
    ref = dense_u(ref_model, x, y, F.cross_entropy, full_grad(ref_model, x, y, F.cross_entropy), 0.05, layer_params(model))
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
    torch.manual_seed(1234)
    opt.mc_capture(out)
    loss.backward()
    # the sampled targets, reproduced with the same seed
    torch.manual_seed(1234)
    o = out.detach()
    if mc_loss == "cross_entropy":
        t = torch.multinomial(torch.softmax(o, -1), 1).squeeze(1)
        torch.manual_seed(1234)
        t32 = torch.multinomial(torch.softmax(o.float(), -1), 1).squeeze(1)
        assert torch.equal(t, t32)
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
def _train(model: nn.Module, opt: TENGraD, batches) -> None:
    for x, y in batches:
        forward_backward(model, opt, x, y)
        opt.step()


def test_state_dict_round_trip_mid_training() -> None:
    kw = dict(lr=0.1, damping=0.1, momentum=0.9, weight_decay=1e-3, curvature_every=1, kl_clip=None)
    batches = [batch("cnn", 8, 40 + t) for t in range(4)]
    net = cnn()
    pristine = copy.deepcopy(net)
    ex = (batches[0][0][:2],)
    model = tengrad_fx.prepare(net, example_inputs=ex)
    opt = TENGraD(model, **kw)
    _train(model, opt, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _train(model, opt, batches[2:])
    A = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert opt.counters["step"] == 4

    buf.seek(0)
    saved = torch.load(buf)
    assert saved["opt"]["state"]["tengrad"]["step"] == 2
    model2 = tengrad_fx.prepare(copy.deepcopy(pristine), example_inputs=ex)
    model2.load_state_dict(saved["model"])
    opt2 = TENGraD(model2, **kw)
    opt2.load_state_dict(saved["opt"])
    assert opt2.counters["step"] == 2
    _train(model2, opt2, batches[2:])
    for n, p in model2.named_parameters():
        torch.testing.assert_close(p.detach(), A[n], rtol=1e-12, atol=1e-12)
    assert opt2.counters == opt.counters


def test_step_lr_scheduler() -> None:
    template, model, opt = setup("mlp", lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    layers = layer_params(model)
    for t, lr in enumerate((0.4, 0.2, 0.1)):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr)
        x, y = batch("mlp", 8, 50 + t)
        ref = snapshot(template, model)
        forward_backward(model, opt, x, y)
        u = dense_u(ref, x, y, F.cross_entropy, full_grad(ref, x, y, F.cross_entropy), 0.05, layers)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        sched.step()
        for n, u_ref in u.items():
            assert rel(before[n] - model.get_parameter(n).detach(), lr * u_ref) <= TOL


# --------------------------------------------------------------------------- failure handling
def test_non_finite_gradient_skips_step() -> None:
    _, model, opt = setup("mlp", momentum=0.9)
    x, y = batch("mlp", 8, 60)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in (1, 2):
            forward_backward(model, opt, x, y)
            model.get_parameter("2.weight").grad[0, 0] = float("nan")
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            opt.step()
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), before[n]), n
            assert opt.counters["skipped"] == k
            assert opt.counters["step"] == 0
            assert not any("momentum_buffer" in opt.state[p] for p in model.parameters())
    ours = [w for w in caught if issubclass(w.category, RuntimeWarning) and "TENGraD" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    # a finite step afterwards goes through
    forward_backward(model, opt, x, y)
    before = model.get_parameter("0.weight").detach().clone()
    opt.step()
    assert not torch.equal(before, model.get_parameter("0.weight"))
    assert opt.counters == {"step": 1, "skipped": 2, "uncaptured": 0}


@pytest.mark.parametrize("kw,arg", [
    (dict(damping=0.0), "damping"), (dict(damping=-1.0), "damping"), (dict(lr=-0.1), "lr"),
    (dict(curvature_every=0), "curvature_every"), (dict(fisher="foo"), "fisher"),
])
def test_bad_arguments(kw: dict, arg: str) -> None:
    _, model, _ = setup("mlp")
    args = dict(lr=0.1, damping=0.1)
    args.update(kw)
    with pytest.raises(ValueError, match=arg):
        TENGraD(model, **args)


def test_unprepared_model_rejected() -> None:
    with pytest.raises(ValueError, match="prepare"):
        TENGraD(mlp(), lr=0.1, damping=0.1)


def test_mc_without_mc_capture_raises() -> None:
    _, model, opt = setup("mlp", fisher="mc")
    x, y = batch("mlp", 8, 70)
    forward_backward(model, opt, x, y)
    with pytest.raises(RuntimeError, match="mc_capture"):
        opt.step()


# --------------------------------------------------------------------------- Theorem 1
def test_theorem1_linear_convergence_overparameterized_relu() -> None:
    """Two-layer over-parameterized ReLU net, n=8, squared loss, full batch.

    Theorem 1 (as Zhang et al. 2019 for NGD) is about the Fisher of the Gaussian model,
    i.e. the Gauss-Newton matrix ``F = J_fᵀJ_f/n`` (``J_f``: Jacobian of the outputs),
    not the empirical Fisher of the loss gradients: ``fisher="gauss-newton"`` through the
    public API (``opt.mc_capture(out)`` before the loss backward).
    With the loss ``½·mean(r²)`` and two blocks, each block's exact update moves the
    outputs by ``−η·r`` (invertible block Grams), so ``η = 1/4`` contracts the residual by
    ``1 − 2η = ½`` per step. The default (empirical-Fisher) run is printed for reference.
    """
    torch.manual_seed(0)
    n, steps, damping = 8, 30, 1e-4
    X = torch.randn(n, 4, dtype=torch.float64)
    X = X / X.norm(dim=1, keepdim=True)
    Y = torch.randn(n, 1, dtype=torch.float64)
    base = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1)).double()

    def loss_fn(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return 0.5 * F.mse_loss(o, t)

    def tengrad(lr: float, fisher: str) -> list[float]:
        model = tengrad_fx.prepare(copy.deepcopy(base), example_inputs=(X[:2],))
        opt = TENGraD(model, lr=lr, damping=damping, momentum=0.0, fisher=fisher, curvature_every=1, kl_clip=None)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            out = model(X)
            loss = loss_fn(out, Y)
            opt.mc_capture(out)  # gauss-newton: J rows = ∇f_i; a no-op for the empirical Fisher
            loss.backward()
            losses.append(loss.item())
            opt.step()
        with torch.no_grad():
            losses.append(loss_fn(model(X), Y).item())
        return losses

    def gd(lr: float) -> list[float]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
        with torch.no_grad():
            losses.append(loss_fn(model(X), Y).item())
        return losses

    def decades(L: list[float]) -> float:
        return math.log10(L[0] / L[-1]) if 0 < L[-1] < math.inf else -math.inf

    ten = tengrad(0.25, "gauss-newton")
    emp = tengrad(0.25, "empirical")
    gds = {lr: gd(lr) for lr in (0.01, 0.03, 0.1, 0.3, 1.0)}
    best_lr = max(gds, key=lambda lr: decades(gds[lr]))
    print(f"\n[theorem1] {steps} steps, loss 0.5*mean(r^2), initial {ten[0]:.3e}")
    print("[theorem1] TENGraD (GN Fisher, lr 0.25, damping 1e-4): "
          + " ".join(f"{v:.1e}" for v in ten[:: 3]) + f" | final {ten[-1]:.2e} ({decades(ten):.1f} decades)")
    print(f"[theorem1] TENGraD (empirical Fisher, lr 0.25): final {emp[-1]:.2e} ({decades(emp):.1f} decades)")
    for lr, L in gds.items():
        print(f"[theorem1] GD lr {lr}: final {L[-1]:.2e} ({decades(L):.2f} decades)")
    print(f"[theorem1] GD best lr {best_lr}: {decades(gds[best_lr]):.2f} decades")

    assert decades(ten) >= 4
    # linear rate: log-loss falls on a line over the steps before round-off (first 12)
    logl = np.log10(np.array(ten[:13]))
    t = np.arange(len(logl))
    slope, icpt = np.polyfit(t, logl, 1)
    r2 = 1 - ((logl - (slope * t + icpt)) ** 2).sum() / ((logl - logl.mean()) ** 2).sum()
    print(f"[theorem1] TENGraD log10-loss slope {slope:.3f}/step (theory ~{2 * math.log10(0.5):.3f}), R^2 {r2:.4f}")
    assert slope < -0.3 and r2 > 0.98
    assert all(b < a for a, b in zip(ten[:13], ten[1:13]))
    assert decades(gds[best_lr]) < 4


# --------------------------------------------------------------------------- real data
FMNIST = "/usr/share/datasets/fashion-mnist"


def _idx(name: str, offset: int) -> np.ndarray:
    with gzip.open(os.path.join(FMNIST, name)) as f:
        return np.frombuffer(f.read(), np.uint8, offset=offset)


def _fmnist(split: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    pre = "train" if split == "train" else "t10k"
    x = _idx(f"{pre}-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)[:n]
    y = _idx(f"{pre}-labels-idx1-ubyte.gz", 8)[:n]
    x = (torch.from_numpy(x.astype(np.float32)) / 255.0 - 0.2860) / 0.3530
    return x, torch.from_numpy(y.astype(np.int64))


def test_short_fashion_mnist_run() -> None:
    if not os.path.exists(os.path.join(FMNIST, "train-images-idx3-ubyte.gz")):
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    x, y = _fmnist("train", 2048)
    xt, yt = _fmnist("test", 1000)
    steps, bs = 30, 128

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(  # 28 → 13 → 6
            nn.Conv2d(1, 16, 3, stride=2), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(16 * 6 * 6, 10),
        )

    def run(name: str) -> tuple[list[float], float, float]:
        model = net()
        if name == "tengrad":
            model = tengrad_fx.prepare(model, example_inputs=(x[:2],))
            opt: torch.optim.Optimizer = TENGraD(model, lr=0.01, damping=0.1, weight_decay=1e-3, curvature_every=1, kl_clip=None)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-3)
        g = torch.Generator().manual_seed(1)
        perm = torch.cat([torch.randperm(len(x), generator=g) for _ in range(2)])
        losses = []
        t0 = time.perf_counter()
        for s in range(steps):
            idx = perm[s * bs: (s + 1) * bs]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        wall = time.perf_counter() - t0
        with torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        return losses, acc, wall

    ten, ten_acc, ten_s = run("tengrad")
    sgd, sgd_acc, sgd_s = run("sgd")
    for name, L, acc, s in (("TENGraD lr 0.01 damping 0.1", ten, ten_acc, ten_s), ("SGD lr 0.03", sgd, sgd_acc, sgd_s)):
        print(f"\n[fmnist] {name} (momentum 0.9, wd 1e-3, batch {bs}, {steps} steps, {s:.1f}s): "
              f"first {L[0]:.3f}, mean last 5 {np.mean(L[-5:]):.3f}, test acc (1000) {acc:.3f}")
    assert all(math.isfinite(v) for v in ten)
    assert np.mean(ten[-5:]) < 0.7 * ten[0]
