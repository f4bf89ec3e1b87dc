"""``TENGraD`` in training: state dicts mid-training, lr schedulers, non-finite steps,
argument checks, Theorem 1's linear convergence and a short real Fashion-MNIST run
(helpers and references: ``testing/tengrad_step.py``)."""
from __future__ import annotations

import copy
import gzip
import io
import math
import os
import time
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from testing.tengrad_step import (
    TOL, batch, cnn, dense_u, forward_backward, full_grad, layer_params, mlp, rel, setup, snapshot,
)

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


def test_mc_without_sampled_backward_raises() -> None:
    """Without the output hook (here switched off) and without ``mc_capture``, no sampled
    backward runs: the curvature step refuses."""
    from tengrad_fx.capture.output_hook import want_output

    _, model, opt = setup("mlp", fisher="mc")
    want_output(tengrad_fx.get_info(model).store.key, None)
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

    def train(model: nn.Module, opt: torch.optim.Optimizer) -> list[float]:
        """Full-batch steps; the loss before each step and after the last."""
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            out = model(X)
            loss = loss_fn(out, Y)
            if isinstance(opt, TENGraD):  # gauss-newton: J rows = ∇f_i; a no-op for the empirical Fisher
                opt.mc_capture(out)
            loss.backward()
            losses.append(loss.item())
            opt.step()
        with torch.no_grad():
            losses.append(loss_fn(model(X), Y).item())
        return losses

    def tengrad(lr: float, fisher: str) -> list[float]:
        model = tengrad_fx.prepare(copy.deepcopy(base), example_inputs=(X[:2],))
        return train(model, TENGraD(model, lr=lr, damping=damping, momentum=0.0, fisher=fisher, curvature_every=1,
                                    kl_clip=None))

    def gd(lr: float) -> list[float]:
        model = copy.deepcopy(base)
        return train(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0))

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
            opt: torch.optim.Optimizer = TENGraD(model, lr=0.01, damping=0.1, weight_decay=1e-3, curvature_every=1,
                                                 kl_clip=None)
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
