"""The MC Fisher without ``opt.mc_capture``: the sampled backward run by the hook on the
prepared model's output (:mod:`tengrad_fx.capture.output_hook`), float64.

* implicit == explicit ``mc_capture`` bit for bit, == the dense block NGD of the same
  sampled labels (fx and module-surgery models, cross-entropy and MSE, GradScaler);
* an explicit call runs the sampled backward once (no double capture); reuse steps
  attach nothing and run no extra backward;
* ``mc_capture`` through wrappers (``__getattr__`` delegation; a copy of the optimizer's
  ``__dict__`` as Lightning's ``LightningOptimizer``) acts on the real optimizer;
* the paper's settings (``make_optimizer(..., dataset=...)``, MC Fisher) train in a plain loop;
* a mask on ``[B, L, V]`` logits leaves its positions out of the sample and the loss.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
import tengrad_fx.optim.step.mc as mc
from tengrad_fx.optim.registry import make_optimizer
from tengrad_fx.utils.dispatch import OpCounter
from testing.tengrad_step import (assert_matches, batch, dense_u, full_grad, layer_params, mc_labels, setup, snapshot,
                                  step_delta)


def _mse_sum_half(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return 0.5 * (o - t).pow(2).reshape(o.shape[0], -1).sum(1).mean()


def _mc_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, explicit: bool, seed: int = 1234,
             loss_fn: Callable[..., torch.Tensor] = F.cross_entropy) -> torch.Tensor:
    """Forward, loss, (``mc_capture``), backward; the sampling RNG seeded after the loss."""
    out = model(x)
    loss = loss_fn(out, y)
    opt.zero_grad()
    opt.seed_mc(seed)
    if explicit:
        opt.mc_capture(out)
    loss.backward()
    return out.detach()


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("mc_loss", ["cross_entropy", "mse"])
def test_implicit_equals_explicit_and_dense(kind: str, mc_loss: str) -> None:
    x, y = batch(kind, 8, 5)
    deltas = []
    for explicit in (True, False):
        template, model, opt = setup(kind, fisher="mc", mc_loss=mc_loss)
        ref_model = snapshot(template, model)
        o = _mc_step(model, opt, x, y, explicit)
        g = full_grad(ref_model, x, y, F.cross_entropy)
        for n, p in model.named_parameters():  # the training backward's gradient is the true labels'
            torch.testing.assert_close(p.grad, g[n], rtol=1e-12, atol=1e-14)
        deltas.append(step_delta(model, opt))
    for k in deltas[0]:
        assert torch.equal(deltas[0][k], deltas[1][k]), k
    torch.manual_seed(1234)
    if mc_loss == "cross_entropy":
        t = mc_labels(o, 1234)
        lossJ: Callable[..., torch.Tensor] = F.cross_entropy
    else:
        t, lossJ = o + torch.randn_like(o), _mse_sum_half
    assert_matches(deltas[1], dense_u(ref_model, x, t, lossJ, g, 0.05, layer_params(model)))


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > -1e9:  # data-dependent control flow: fx cannot trace it
            x = x * 1.0
        return self.fc2(torch.tanh(self.fc1(x)))


def test_surgery_model_implicit_equals_explicit() -> None:
    x, y = batch("mlp", 8, 6)
    params = []
    for explicit in (True, False):
        torch.manual_seed(0)
        model = tengrad_fx.prepare(_Untraceable().double(), example_inputs=(x[:2],))
        assert tengrad_fx.get_info(model).method == "surgery"
        opt = tengrad_fx.TENGraD(model, lr=0.5, damping=0.1, fisher="mc", curvature_every=2)
        for t in range(3):
            _mc_step(model, opt, x, y, explicit, seed=t)
            opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_gauss_newton_implicit_equals_explicit() -> None:
    x, y = batch("mlp", 8, 7)
    yr = torch.randn(8, 4, dtype=torch.float64)
    deltas = []
    for explicit in (True, False):
        _, model, opt = setup("mlp", fisher="gauss-newton")
        _mc_step(model, opt, x, yr, explicit, loss_fn=_mse_sum_half)
        deltas.append(step_delta(model, opt))
    assert all(torch.equal(deltas[0][k], deltas[1][k]) for k in deltas[0])


def test_grad_scaler_implicit_equals_explicit() -> None:
    x, y = batch("mlp", 8, 8)
    params = []
    for explicit in (True, False):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        _, model, opt = setup("mlp", fisher="mc", grad_scaler=scaler, lr=0.1, kl_clip=0.01, curvature_every=2)
        for t in range(3):
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            opt.seed_mc(t)
            if explicit:
                opt.mc_capture(out)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_explicit_call_samples_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = mc.second_backward
    monkeypatch.setattr(mc, "second_backward", lambda *a: (calls.append(1), real(*a)))
    _, model, opt = setup("mlp", fisher="mc")
    x, y = batch("mlp", 8, 9)
    for explicit in (True, False, True):
        out = _mc_step(model, opt, x, y, explicit)
        opt.mc_capture(out)  # after the backward: this forward's sampled backward has run
        opt.step()
    assert len(calls) == 3


def test_reuse_steps_attach_nothing_and_cost_what_empirical_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Curvature every 3 steps: the sampled backward runs on steps 0 and 3 only; a reuse
    step's forward/backward/step dispatches exactly the empirical-Fisher optimizer's ops."""
    calls = []
    real = mc.second_backward
    monkeypatch.setattr(mc, "second_backward", lambda *a: (calls.append(1), real(*a)))
    x, y = batch("mlp", 8, 10)
    ops = {}
    for fisher in ("mc", "empirical"):
        _, model, opt = setup("mlp", fisher=fisher, curvature_every=3, lr=0.1)
        ops[fisher] = []
        for t in range(5):
            with OpCounter() as oc:
                out = model(x)
                if t % 3:
                    assert out._backward_hooks is None  # nothing attached on reuse steps
                F.cross_entropy(out, y).backward()
                opt.step()
                opt.zero_grad()
            ops[fisher].append(oc.ops)
    assert len(calls) == 2
    for t in (1, 2, 4):
        assert ops["mc"][t] == ops["empirical"][t], t


class _Delegating:
    """A wrapper that forwards every other attribute to the optimizer (``__getattr__``)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)


def _lightning_style(optimizer: Any) -> Any:
    """As ``lightning.pytorch.core.optimizer.LightningOptimizer``: an object of a subclass of
    the optimizer's class holding a copy of its ``__dict__``; ``step`` goes to the original."""
    cls = type(optimizer)
    wrapper = object.__new__(type("Lightning" + cls.__name__, (cls,), {}))
    wrapper.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "__del__")}
    wrapper.step = optimizer.step
    return wrapper


@pytest.mark.parametrize("wrap", [_Delegating, _lightning_style], ids=["getattr", "dict-copy"])
def test_mc_capture_through_wrapper(wrap: Callable[[Any], Any]) -> None:
    x, y = batch("mlp", 8, 11)
    params = []
    for wrapped in (False, True):
        _, model, opt = setup("mlp", fisher="mc", curvature_every=2, lr=0.1)
        handle = wrap(opt) if wrapped else opt
        for t in range(4):
            _mc_step(model, handle, x, y, explicit=True, seed=t)
            handle.step()
        assert opt.counters["step"] == 4
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


@pytest.mark.parametrize("name,kw", [("tengrad", {"curvature_every": 2}),
                                     ("kfac", {"curvature_every": 1, "inverse_every": 2}),
                                     ("ekfac", {"curvature_every": 1, "rescale_every": 1, "inverse_every": 2})])
def test_paper_settings_train_in_plain_loop(name: str, kw: dict[str, Any]) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(32, 6)
    y = (x[:, :4]).argmax(1)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = make_optimizer(name, model, dataset="fashion-mnist", **kw)
    assert opt.fisher == "mc"
    losses = []
    for _ in range(6):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert opt.counters["step"] == 6 and opt.counters["skipped"] == 0
    assert losses[-1] < losses[0]


@pytest.mark.filterwarnings("ignore:TENGraD. several capturing backwards")
def test_non_tensor_output_needs_the_explicit_call() -> None:
    class TwoOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.fc(x)
            return h, h.sum(1)

    x, y = batch("mlp", 8, 12)
    model = tengrad_fx.prepare(TwoOut().double(), example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(model, lr=0.1, damping=0.1, fisher="mc")
    F.cross_entropy(model(x)[0], y).backward()
    with pytest.raises(RuntimeError, match="mc_capture"):
        opt.step()
    opt.zero_grad()
    out, _ = model(x)
    opt.mc_capture(out)
    F.cross_entropy(out, y).backward()
    opt.step()
    assert opt.counters["step"] == 1


# --------------------------------------------------------------------------- masked sequences
def _seq_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 5)).double()


@pytest.mark.parametrize("masked", [True, False])
def test_masked_sequence_mc_equals_reference(masked: bool) -> None:
    """Logits ``[B, L, V]``; the reference draws every position (the same RNG), keeps the
    unmasked labels, and builds ``J`` from per-sample gradients of the kept positions' sum
    scaled as the sampled loss (mean over the kept positions, times ``B``)."""
    B, L, V = 4, 5, 5
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, L, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (B, L), generator=g)
    mask = torch.rand(B, L, generator=g) > 0.35 if masked else torch.ones(B, L, dtype=torch.bool)
    mask[0, 0] = True
    y_train = y.masked_fill(~mask, -100)
    net = _seq_model()
    template = copy.deepcopy(net)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None,
                             fisher="mc")
    ref_model = snapshot(template, model)
    out = model(x)
    loss = F.cross_entropy(out.reshape(-1, V), y_train.reshape(-1))
    opt.seed_mc(7)
    opt.mc_capture(out, mask=mask)
    loss.backward()
    delta = step_delta(model, opt)

    t = mc_labels(out, 7).masked_fill(~mask, -100)
    n_kept = int(mask.sum())

    def lossJ(o: torch.Tensor, ti: torch.Tensor) -> torch.Tensor:  # one sample: [1, L, V], [1, L]
        return F.cross_entropy(o.reshape(-1, V), ti.reshape(-1), reduction="sum") * (B / n_kept)

    gr = full_grad(ref_model, x, y_train, lambda o, yy: F.cross_entropy(o.reshape(-1, V), yy.reshape(-1)))
    assert_matches(delta, dense_u(ref_model, x, t, lossJ, gr, 0.05, layer_params(model)))


def test_mask_rows_are_not_read_and_shapes_are_checked() -> None:
    """Masked positions with non-finite logits still sample (uniform stand-in, label -100);
    the kept labels equal an unmasked draw's; a mask of another shape is refused."""
    g = torch.Generator().manual_seed(4)
    o = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 4, generator=g) > 0.5
    torch.manual_seed(0)
    full = mc.sample_targets(o, "cross_entropy")
    o_bad = o.masked_fill(~mask.unsqueeze(-1), float("nan"))
    torch.manual_seed(0)
    t = mc.sample_targets(o_bad, "cross_entropy", mask=mc.check_mask(o_bad, mask, "cross_entropy"))
    assert torch.equal(t, full.masked_fill(~mask, -100))
    with pytest.raises(ValueError, match="mask"):
        mc.check_mask(o, mask[:, :3], "cross_entropy")


def test_compiled_model_implicit_equals_explicit() -> None:
    """``torch.compile`` of the prepared model: the output hook is attached outside the
    compiled graph (a graph break on capturing forwards only); the same bits as the call."""
    torch._dynamo.reset()
    x, y = batch("mlp", 8, 13)
    params = []
    for explicit in (True, False):
        _, model, opt = setup("mlp", fisher="mc", curvature_every=2, lr=0.1)
        compiled = torch.compile(model)
        for t in range(3):
            _mc_step(compiled, opt, x, y, explicit, seed=t)
            opt.step()
        assert opt.counters["step"] == 3
        params.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*params))


def test_fullgraph_compiled_model_takes_the_explicit_call() -> None:
    """``fullgraph=True`` forbids the hook's graph break: nothing is attached, the explicit
    call works as before, and a curvature step without it raises."""
    torch._dynamo.reset()
    x, y = batch("mlp", 8, 14)
    _, model, opt = setup("mlp", fisher="mc", curvature_every=2, lr=0.1)
    compiled = torch.compile(model, fullgraph=True)
    for t in range(4):
        _mc_step(compiled, opt, x, y, explicit=True, seed=t)
        opt.step()
    assert opt.counters["step"] == 4  # the next step takes curvature
    out = compiled(x)
    assert out._backward_hooks is None
    opt.zero_grad()
    F.cross_entropy(out, y).backward()
    with pytest.raises(RuntimeError, match="mc_capture"):
        opt.step()
