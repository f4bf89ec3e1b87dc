"""Shared models and helpers of the prepare() tests (tests/capture/test_prepare_*.py)."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from tengrad_fx import covered_layers, get_info, prepare
from testing import explicit_jacobian, per_sample_grads_reference


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def sq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over samples of a per-sample squared error (any output shape)."""
    return ((out - y) ** 2).flatten(1).sum(1).mean()


def n_records(model: nn.Module) -> int:
    return sum(len(v) for v in get_info(model).store.records.values())


def check_psg(prepared: nn.Module, ref_model: nn.Module, x, y, loss_fn=sq_loss, tol=1e-10,
               ref: dict | None = None, layers: list[str] | None = None) -> dict:
    """Backward ``loss_fn`` through ``prepared``; compare each covered layer's per-sample
    gradients with the ``torch.func`` oracle on ``ref_model`` (the unprepared original).
    Returns the oracle's per-sample gradients."""
    for p in prepared.parameters():
        p.grad = None
    loss_fn(prepared(x), y).backward()
    if ref is None:
        ref = per_sample_grads_reference(ref_model, x, loss_fn, y)
    names = {id(p): k for k, p in prepared.named_parameters()}
    checked = 0
    for layer in covered_layers(prepared):
        if layers is not None and layer.name not in layers:
            continue
        dW, db = layer.per_sample_grads()
        wn = names[id(layer.weight)]
        assert dW.shape == ref[wn].shape, wn
        assert rel(dW, ref[wn]) <= tol, (wn, rel(dW, ref[wn]))
        if layer.bias is not None:
            bn = names[id(layer.bias)]
            assert rel(db, ref[bn]) <= tol, (bn, rel(db, ref[bn]))
        checked += 1
    assert checked, "no covered layer compared"
    return ref


def check_gram(prepared: nn.Module, ref: dict, tol: float = 1e-10) -> None:
    """Every covered layer's Gram (each strategy), ``jvp`` and ``vjp`` against the explicit
    ``J`` of the oracle's per-sample gradients ``ref`` (same capture as the last backward)."""
    names = {id(p): k for k, p in prepared.named_parameters()}
    for layer in covered_layers(prepared):
        bn = names[id(layer.bias)] if layer.bias is not None else None
        J = explicit_jacobian(ref, names[id(layer.weight)], bn)
        K = J @ J.T
        for how in ("factor", "materialize", "auto"):
            assert rel(layer.gram(how), K) <= tol, (layer.name, how, rel(layer.gram(how), K))
        v = torch.randn(J.shape[1], dtype=J.dtype)
        nw = layer.weight.numel()
        vb = v[nw:].view_as(layer.bias) if layer.bias is not None else None
        assert rel(layer.jvp(v[:nw].view_as(layer.weight), vb), J @ v) <= tol, layer.name
        c = torch.randn(J.shape[0], dtype=J.dtype)
        gw, gb = layer.vjp(c)
        got = gw.flatten() if gb is None else torch.cat([gw.flatten(), gb.flatten()])
        assert rel(got, J.T @ c) <= tol, layer.name


def loop_psg(model: nn.Module, x, y, loss_fn=sq_loss, take=None) -> dict[str, torch.Tensor]:
    """Per-sample gradients by one backward per sample (for models vmap cannot run);
    ``take(x, i)`` gives sample ``i`` of the inputs with its batch dim (default ``x[i:i+1]``)."""
    out: dict[str, list[torch.Tensor]] = {k: [] for k, _ in model.named_parameters()}
    for i in range(y.shape[0]):
        model.zero_grad(set_to_none=True)
        xi = x[i:i + 1] if take is None else take(x, i)
        loss_fn(model(xi), y[i:i + 1]).backward()
        for k, p in model.named_parameters():
            out[k].append(p.grad.clone())
    model.zero_grad(set_to_none=True)
    return {k: torch.stack(v) for k, v in out.items()}


class CNN(nn.Module):
    """conv-bn-relu, depthwise conv, pool, linear: a little of everything."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.conv1(x)))
        h = F.adaptive_avg_pool2d(F.relu(self.conv2(h)), 4)
        return self.fc(h.flatten(1))


class MLP(nn.Module):
    def __init__(self, d=6, h=7, c=3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, c)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


class Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if x.abs().sum() > 0:  # true for any nonzero input, but fx cannot know
            h = 2 * h
        return self.fc2(h)


def cnn_batch(m=3):
    torch.manual_seed(0)
    return torch.randn(m, 3, 8, 8), torch.randint(0, 5, (m,))



def prepared_cnn():
    x, y = cnn_batch()
    return prepare(CNN(), example_inputs=(x[:2],)), x, y


def step(model, x, y) -> torch.Tensor:
    out = model(x)
    F.cross_entropy(out, y).backward()
    return out



class WSConv2d(nn.Conv2d):
    """Weight-standardized conv: overrides forward."""

    def forward(self, x):
        w = self.weight
        w = (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class PlainSubLinear(nn.Linear):
    """A subclass that does not override forward: still exactly nn.Linear."""


class WithSubclasses(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ws = WSConv2d(3, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = PlainSubLinear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(torch.tanh(self.ws(x)))).flatten(1))



class TiedLM(nn.Module):
    """Output Linear's weight tied to the Embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.out = nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.body(self.emb(tokens))))



class TiedPair(nn.Module):
    """Two covered Linears sharing one weight Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))



class KwargCall(nn.Module):
    """A covered module called once normally and once with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)) + self.fc(input=x))



class Dual(nn.Module):
    """Train mode returns an extra auxiliary output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        out = self.head(h)
        if self.training:
            return out, self.aux(h)
        return out


class Sandwich(nn.Module):
    """``Linear(5, 4) → mid → tanh → mean over positions → Linear(4, 3)`` on ``[m, 3, 5]``."""

    def __init__(self, mid: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 4)
        self.mid = mid
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.inp(x))).mean(1))


def prepared_sandwich(mid: nn.Module, m: int = 5):
    """``(prepared, orig, x, y)``: a float64 :class:`Sandwich` around ``mid`` prepared on
    ``x[:2]``, its unprepared copy, and a batch of ``m`` with class targets."""
    torch.manual_seed(0)
    model = Sandwich(mid).double()
    orig = copy.deepcopy(model)
    x, y = torch.randn(m, 3, 5, dtype=torch.float64), torch.randint(0, 3, (m,))
    return prepare(model, example_inputs=(x[:2],)), orig, x, y
