"""Semantics of :func:`tengrad_fx.prepare` on small hand-written models.

No hooks; same Parameters and state_dict; capture switched off / on; release of the
previous step; sample-dimension checks; weight sharing and tying; subclasses; dual
graphs; the module-surgery fallback; every conv padding flavour against the
``torch.func`` per-sample oracle in float64; error messages; the report; torch.compile.
"""
from __future__ import annotations

import copy
import gc
import pathlib
import re
import time
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import capturing, covered_layers, get_info, prepare
from testing import per_sample_grads_reference

PKG = pathlib.Path(tengrad_fx.__file__).parent


# --------------------------------------------------------------------------- helpers
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _sq_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over samples of a per-sample squared error (any output shape)."""
    return ((out - y) ** 2).flatten(1).sum(1).mean()


def _n_records(model: nn.Module) -> int:
    return sum(len(v) for v in get_info(model).store.records.values())


def _check_psg(prepared: nn.Module, ref_model: nn.Module, x, y, loss_fn=_sq_loss, tol=1e-10,
               ref: dict | None = None, layers: list[str] | None = None) -> None:
    """Backward ``loss_fn`` through ``prepared``; compare each covered layer's per-sample
    gradients with the ``torch.func`` oracle on ``ref_model`` (the unprepared original)."""
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
        assert _rel(dW, ref[wn]) <= tol, (wn, _rel(dW, ref[wn]))
        if layer.bias is not None:
            bn = names[id(layer.bias)]
            assert _rel(db, ref[bn]) <= tol, (bn, _rel(db, ref[bn]))
        checked += 1
    assert checked, "no covered layer compared"


def _loop_psg(model: nn.Module, x, y, loss_fn=_sq_loss) -> dict[str, torch.Tensor]:
    """Per-sample gradients by one backward per sample (for models vmap cannot run)."""
    out: dict[str, list[torch.Tensor]] = {k: [] for k, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
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


def _cnn_batch(m=3):
    torch.manual_seed(0)
    return torch.randn(m, 3, 8, 8), torch.randint(0, 5, (m,))


# --------------------------------------------------------------------------- no hooks
HOOK_CALLS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_full_backward_pre_hook", "register_backward_hook", ".register_hook(",
              "register_module_forward_hook", "register_module_forward_pre_hook",
              "register_module_full_backward_hook", "register_post_accumulate_grad_hook",
              "register_multi_grad_hook")


def test_package_source_registers_no_hooks() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) >= 8
    offenders = [f"{f.relative_to(PKG)}: {pat}" for f in files for pat in HOOK_CALLS
                 if pat in f.read_text()]
    assert not offenders, offenders


def _global_hook_dicts() -> dict[str, dict]:
    mod = torch.nn.modules.module
    return {n: getattr(mod, n) for n in dir(mod) if n.startswith("_global_") and n.endswith("hooks")
            and isinstance(getattr(mod, n), dict)}


@pytest.mark.parametrize("method", ["fx", "surgery"])
def test_no_hooks_after_prepare_and_training_step(method: str) -> None:
    assert {"_global_forward_hooks", "_global_backward_hooks",
            "_global_forward_pre_hooks"} <= set(_global_hook_dicts())
    if method == "fx":
        model, (x, y) = CNN(), _cnn_batch()
        loss_fn = F.cross_entropy
    else:
        model, x, y = Untraceable(), torch.randn(3, 6), torch.randn(3, 3)
        loss_fn = _sq_loss
    prepared = prepare(model, example_inputs=(x[:2],))
    assert get_info(prepared).method == method
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(prepared(x), y).backward()
        opt.step()
    assert _n_records(prepared) > 0  # it did capture
    for name, mod in list(prepared.named_modules()) + list(model.named_modules()):
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            assert not getattr(mod, attr), (name, attr)
        assert not getattr(mod, "_is_full_backward_hook", None), name
    for n, d in _global_hook_dicts().items():
        assert not d, n
    for k, p in prepared.named_parameters():  # no tensor hooks either
        assert not p._backward_hooks, k
        assert not getattr(p, "_post_accumulate_grad_hooks", None), k


# --------------------------------------------------------------------------- parameters, state_dict
def test_same_parameters_and_state_dict_keys() -> None:
    model = CNN()
    before = dict(model.named_parameters())
    keys = list(model.state_dict().keys())
    prepared = prepare(model, example_inputs=(_cnn_batch()[0][:2],))
    assert list(prepared.state_dict().keys()) == keys
    after = dict(prepared.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert [id(p) for p in prepared.parameters()] == [id(p) for p in model.parameters()]
    assert all(a is b for a, b in zip(prepared.buffers(), model.buffers(), strict=True))
    # covered layers hand out the same objects too
    for layer in covered_layers(prepared):
        assert layer.weight is before[layer.name + ".weight"]


def test_optimizer_built_before_prepare_updates_prepared_model() -> None:
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _cnn_batch()
    prepared = prepare(model, example_inputs=(x[:2],))
    start = {k: p.detach().clone() for k, p in prepared.named_parameters()}
    F.cross_entropy(prepared(x), y).backward()
    grads = {k: p.grad.clone() for k, p in prepared.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    opt.step()
    for k, p in prepared.named_parameters():
        torch.testing.assert_close(p.detach(), start[k] - 0.5 * grads[k])
    # the optimizer's own parameter list is the prepared model's
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in prepared.parameters()}


def test_state_dict_loads_both_ways() -> None:
    x, _ = _cnn_batch()
    torch.manual_seed(1)
    a = CNN()
    torch.manual_seed(2)
    b = CNN()
    pa = prepare(a, example_inputs=(x[:2],))
    pa.eval()
    b.eval()
    assert not torch.allclose(pa(x), b(x))
    # plain -> prepared
    pa.load_state_dict(b.state_dict())
    torch.testing.assert_close(pa(x), b(x), rtol=0, atol=0)
    # prepared -> plain
    torch.manual_seed(3)
    c = CNN().eval()
    c.load_state_dict(pa.state_dict())
    torch.testing.assert_close(c(x), pa(x), rtol=0, atol=0)
    # strict loading: the same keys, nothing missing nor unexpected
    res = pa.load_state_dict(CNN().state_dict(), strict=True)
    assert not res.missing_keys and not res.unexpected_keys


# --------------------------------------------------------------------------- capture on / off
def _prepared_cnn():
    x, y = _cnn_batch()
    return prepare(CNN(), example_inputs=(x[:2],)), x, y


def _step(model, x, y) -> torch.Tensor:
    out = model(x)
    F.cross_entropy(out, y).backward()
    return out


def test_capturing_false_records_nothing_and_uses_plain_ops() -> None:
    prepared, x, y = _prepared_cnn()
    _step(prepared, x, y)
    grads_on = [p.grad.clone() for p in prepared.parameters()]
    prepared.zero_grad()
    get_info(prepared).store.clear()
    capturing(prepared, False)
    out = _step(prepared, x, y)
    assert get_info(prepared).store.records == {}
    assert "tengrad" not in out.grad_fn.name()  # plain aten op, no capture node in the graph
    for g, p in zip(grads_on, prepared.parameters()):
        torch.testing.assert_close(p.grad, g)  # same gradients
    capturing(prepared, True)
    out = _step(prepared, x, y)
    assert "tengrad" in out.grad_fn.name()
    assert _n_records(prepared) == len(covered_layers(prepared))


def test_capturing_context_manager_restores_state() -> None:
    prepared, x, y = _prepared_cnn()
    store = get_info(prepared).store
    with capturing(prepared, False):
        _step(prepared, x, y)
        assert store.records == {}
    _step(prepared, x, y)
    assert _n_records(prepared) == 3
    capturing(prepared, False)
    store.clear()
    with capturing(prepared, True):
        _step(prepared, x, y)
    assert _n_records(prepared) == 3
    store.clear()
    _step(prepared, x, y)  # off again after the block
    assert store.records == {}


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
def test_nothing_retained_without_grad(ctx: str) -> None:
    prepared, x, _ = _prepared_cnn()
    store = get_info(prepared).store
    cm = torch.no_grad() if ctx == "no_grad" else torch.inference_mode()
    with cm:
        out = prepared(x)
    assert out.grad_fn is None
    assert store.records == {}
    # and a previous step's capture is left alone by a forward that captures nothing
    y = torch.tensor([0, 1, 2])
    _step(prepared, x, y)
    recs = dict(store.records)
    with (torch.no_grad() if ctx == "no_grad" else torch.inference_mode()):
        prepared(x)
    assert store.records == recs


def test_eval_mode_still_captures() -> None:
    prepared, x, y = _prepared_cnn()
    prepared.eval()
    _step(prepared, x, y)
    assert _n_records(prepared) == 3
    for layer in covered_layers(prepared):
        assert layer.m == 3


def test_new_capture_releases_previous_step() -> None:
    prepared, x, y = _prepared_cnn()
    store = get_info(prepared).store
    _step(prepared, x, y)
    site = covered_layers(prepared)[1].spec.sites[0]  # conv2: input is an inner activation
    rec = store.records[site][0]
    refs = [weakref.ref(rec)] + [weakref.ref(t) for t in (rec.I, rec.G, rec.P, rec.Gsum) if t is not None]
    assert len(refs) >= 3
    gen = store.generation
    del rec
    prepared.zero_grad()
    out = prepared(x)  # the next capturing forward: previous records are dropped now
    gc.collect()
    assert all(r() is None for r in refs), "previous step's captured tensors still alive"
    assert store.records == {}
    F.cross_entropy(out, y).backward()
    assert store.generation == gen + 1
    assert _n_records(prepared) == 3


# --------------------------------------------------------------------------- sample dimension
class Folded(nn.Module):
    """(B, T, D) -> (B*T, D) before a Linear: its rows are not samples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x.reshape(-1, x.shape[-1]))
        h = h.reshape(x.shape[0], x.shape[1], -1)
        return self.out(torch.tanh(h).mean(1))


class Grid(nn.Module):
    """A conv applied to a constant (1, C, H, W) grid, broadcast-added to the features."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("grid", torch.randn(1, 2, 6, 6))
        self.pos = nn.Conv2d(2, 4, 3, padding=1)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        h = self.conv(x) + self.pos(self.grid)
        return self.fc(torch.tanh(h).flatten(1))


class Seq(nn.Module):
    """Linear on (B, T, D) and on (B, T1, T2, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.fc3 = nn.Linear(3, 2, bias=False)

    def forward(self, x):  # x: (B, T, 4)
        h = self.fc2(F.gelu(self.fc1(x)))  # (B, T, 3)
        h = h.unsqueeze(2) * h.unsqueeze(1)  # (B, T, T, 3)
        return self.fc3(torch.tanh(h))  # (B, T, T, 2)


def test_batch_folded_linear_is_fallback_with_example_inputs() -> None:
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    model = Folded().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert "fc.weight" in info.fallback and "fc.bias" in info.fallback
    assert "does not index samples" in info.fallback["fc.weight"]
    assert [layer.name for layer in covered_layers(prepared)] == ["out"]
    assert info.covered == {"out.weight": "out", "out.bias": "out"}
    y = torch.randn(3, 3, dtype=torch.float64)
    _check_psg(prepared, orig, x, y)  # 'out' still exact
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    # the fallback's gradient is still the full one
    orig.zero_grad()
    _sq_loss(orig(x), y).backward()
    torch.testing.assert_close(prepared.fc.weight.grad, orig.fc.weight.grad)


def test_batch_folded_linear_without_example_inputs_raises_at_run_time() -> None:
    x = torch.randn(3, 5, 4)
    prepared = prepare(Folded())
    assert not get_info(prepared).verified
    with torch.no_grad():  # nothing captured, nothing checked
        prepared(x)
    with pytest.raises(RuntimeError, match=r"layer 'fc'.*does not index\s+samples"):
        prepared(x)
    with capturing(prepared, False):
        prepared(x).sum().backward()


def test_constant_grid_conv_is_fallback() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 3, 6, 6, dtype=torch.float64)
    model = Grid().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert "does not index samples" in info.fallback["pos.weight"]
    assert "does not index samples" in info.fallback["pos.bias"]
    assert {layer.name for layer in covered_layers(prepared)} == {"conv", "fc"}
    _check_psg(prepared, orig, x, torch.randn(3, 3, dtype=torch.float64))
    # without example_inputs the run-time check names the layer
    p2 = prepare(copy.deepcopy(orig))
    with pytest.raises(RuntimeError, match="'pos'"):
        p2(x)


def test_linear_on_sequences_is_covered_and_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    model = Seq().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert set(info.covered) == {k for k, _ in orig.named_parameters()}
    assert info.fallback == {}
    y = torch.randn(3, 4, 4, 2, dtype=torch.float64)
    _check_psg(prepared, orig, x, y)
    store = get_info(prepared).store
    (site,) = {layer.name: layer for layer in covered_layers(prepared)}["fc3"].spec.sites
    (rec,) = store.records[site]
    assert rec.I is None or tuple(rec.I.shape) == (3, 4, 4, 3)  # Linear input kept as (B, T, T, D)


def test_sequences_without_example_inputs_run_and_are_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    model = Seq().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model)
    _check_psg(prepared, orig, x, torch.randn(3, 4, 4, 2, dtype=torch.float64))


# --------------------------------------------------------------------------- weight sharing / tying
class Shared(nn.Module):
    """One Linear applied on two branches (and reachable under a second name)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)
        self.alias = self.fc  # the same module registered twice: sharing, not tying

    def forward(self, x):
        a = self.fc(x)
        b = self.alias(torch.tanh(x) * 2)
        return self.out(torch.tanh(a) + b)


def test_module_called_twice_is_exact_with_two_sites() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64)
    model = Shared().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    layers = {layer.name: layer for layer in covered_layers(prepared)}
    assert set(layers) == {"fc", "out"}
    assert len(layers["fc"].spec.sites) == 2 and len(layers["out"].spec.sites) == 1
    assert "calls=2" in str(tengrad_fx.report(prepared))
    y = torch.randn(4, 2, dtype=torch.float64)
    _check_psg(prepared, orig, x, y)
    assert len(layers["fc"].records()) == 2


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


def test_subclass_overriding_forward_is_fallback() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64)
    model = WithSubclasses().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert re.search(r"WSConv2d overrides Conv2d\.forward", info.fallback["ws.weight"])
    assert "ws.bias" in info.fallback
    assert {layer.name for layer in covered_layers(prepared)} == {"conv", "fc"}
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    _check_psg(prepared, orig, x, torch.randn(3, 3, dtype=torch.float64))


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


def test_weight_tied_to_embedding_is_fallback() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (3, 4))
    model = TiedLM().double()
    orig = copy.deepcopy(model)
    keys = list(model.state_dict().keys())
    prepared = prepare(model, example_inputs=(tokens[:2],))
    info = get_info(prepared)
    assert list(prepared.state_dict().keys()) == keys  # both emb.weight and out.weight
    assert "tied" in info.fallback["emb.weight"]
    assert {layer.name for layer in covered_layers(prepared)} == {"body"}
    assert prepared.out.weight is prepared.emb.weight
    y = torch.randn(3, 4, 11, dtype=torch.float64)
    _check_psg(prepared, orig, tokens, y)


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


class FunctionalReuse(nn.Module):
    """A covered weight also used functionally (F.linear) elsewhere in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        # reading only metadata (.shape) is not a use
        h = self.fc(x) + F.linear(x, self.fc.weight).reshape(-1, self.fc.weight.shape[0])
        return self.out(torch.tanh(h))


class KwargCall(nn.Module):
    """A covered module called once normally and once with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)) + self.fc(input=x))


class MetaOnly(nn.Module):
    """Reads a covered weight's dtype/shape only: still covered."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        x = x.to(self.fc.weight.dtype).reshape(x.shape[0], self.fc.weight.shape[1])
        return self.out(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("cls, dropped, why", [
    (TiedPair, {"a", "b"}, "tied"),
    (FunctionalReuse, {"fc"}, "read outside the layer call"),
    (KwargCall, {"fc"}, "keyword"),
    (MetaOnly, set(), ""),
])
def test_shared_weights_are_exact_or_fallback(cls, dropped, why) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    model = cls().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    names = {layer.name for layer in covered_layers(prepared)}
    linears = {n for n, mod in orig.named_modules() if isinstance(mod, nn.Linear)}
    assert names == linears - dropped, names
    for k, _ in orig.named_parameters():
        if k.split(".")[0] in dropped:
            assert why in info.fallback[k], (k, info.fallback.get(k))
        else:
            assert k in info.covered, k
    # covered_layers never hands out a parameter reported as fallback
    for layer in covered_layers(prepared):
        for p in (layer.weight, layer.bias):
            assert all(q is not p for k, q in prepared.named_parameters() if k in info.fallback)
    _check_psg(prepared, orig, x, torch.randn(3, 2, dtype=torch.float64))


# --------------------------------------------------------------------------- dual graph
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


def test_train_eval_difference_gives_dual_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64)
    model = Dual().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "fx-dual"
    assert "train/eval differ" in str(tengrad_fx.report(prepared))
    assert {layer.name for layer in covered_layers(prepared)} == {"body", "head", "aux"}
    # train mode: the tuple, and aux is captured
    prepared.train()
    orig.train()
    out, aux = prepared(x)
    o_ref, a_ref = orig(x)
    torch.testing.assert_close(out, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(aux, a_ref, rtol=0, atol=0)
    (out.sum() + aux.square().sum()).backward()
    assert {layer.name for layer in covered_layers(prepared) if get_info(prepared).store.records.get(
        layer.spec.sites[0])} == {"body", "head", "aux"}
    # eval mode: the tensor, and per-sample grads are exact
    prepared.eval()
    orig.eval()
    res = prepared(x)
    assert isinstance(res, torch.Tensor)
    torch.testing.assert_close(res, orig(x), rtol=0, atol=0)
    _check_psg(prepared, orig, x, torch.randn(3, 3, dtype=torch.float64), layers=["body", "head"])


class Constants(nn.Module):
    """Tensors that are neither parameters nor buffers: a plain attribute, and constants
    created in forward (the tracer stores those on the root module), different per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # plain attribute

    def forward(self, x):
        h = self.fc(x) * self.scale + torch.tensor([0.5, -0.5, 0.25, 0.0])
        if self.training:
            h = h * torch.tensor([2.0, 1.0, 1.0, 3.0])
        return self.out(torch.tanh(h))


def test_tensor_constants_survive_and_original_is_untouched() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = Constants()
    orig = copy.deepcopy(model)
    attrs = set(model.__dict__)
    keys = list(model.state_dict())
    prepared = prepare(model, example_inputs=(x[:2],))
    assert get_info(prepared).method == "fx-dual"
    assert set(model.__dict__) == attrs  # no tracer constants left on the original
    assert list(prepared.state_dict()) == keys
    assert {layer.name for layer in covered_layers(prepared)} == {"fc", "out"}
    for mode in (True, False):
        prepared.train(mode)
        orig.train(mode)
        torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    prepared.train()
    prepared(x).sum().backward()
    assert _n_records(prepared) == 2


# --------------------------------------------------------------------------- untraceable
def test_untraceable_without_example_inputs_raises() -> None:
    with pytest.raises(RuntimeError, match="example_inputs"):
        prepare(Untraceable())


def test_untraceable_uses_module_surgery_and_is_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64)
    model = Untraceable().double()
    orig = copy.deepcopy(model)
    params = dict(model.named_parameters())
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "surgery"
    assert info.trace_error
    assert "module surgery" in str(tengrad_fx.report(prepared))
    assert all(p is params[k] for k, p in prepared.named_parameters())
    assert list(prepared.state_dict()) == list(orig.state_dict())
    assert {layer.name for layer in covered_layers(prepared)} == {"fc1", "fc2"}
    y = torch.randn(3, 3, dtype=torch.float64)
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    _check_psg(prepared, orig, x, y, ref=_loop_psg(orig, x, y))
    # capture off works there too
    get_info(prepared).store.clear()
    with capturing(prepared, False):
        _sq_loss(prepared(x), y).backward()
    assert get_info(prepared).store.records == {}


class UntraceableFolded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        if x.abs().sum() > 0:
            x = x * 1.5
        h = self.fc(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], x.shape[1], -1)
        return self.out(torch.tanh(h).mean(1))


def test_surgery_batch_folded_layer_is_fallback_and_runs() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    model = UntraceableFolded().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "surgery"
    assert "does not index samples" in info.fallback["fc.weight"]
    assert [layer.name for layer in covered_layers(prepared)] == ["out"]
    y = torch.randn(3, 3, dtype=torch.float64)
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    _check_psg(prepared, orig, x, y, ref=_loop_psg(orig, x, y))


def test_surgery_tied_pair_is_fallback() -> None:
    class UntraceableTied(TiedPair):
        def forward(self, x):
            if x.abs().sum() > 0:
                x = -x
            return super().forward(x)

    x = torch.randn(3, 4, dtype=torch.float64)
    model = UntraceableTied().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "surgery"
    assert "tied" in info.fallback["a.weight"]
    assert [layer.name for layer in covered_layers(prepared)] == ["out"]
    y = torch.randn(3, 2, dtype=torch.float64)
    _check_psg(prepared, orig, x, y, ref=_loop_psg(orig, x, y))


def test_surgery_keyword_call_is_captured() -> None:
    class UntraceableKwarg(KwargCall):
        def forward(self, x):
            if x.abs().sum() > 0:
                x = -x
            return super().forward(x)

    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    model = UntraceableKwarg().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    assert get_info(prepared).method == "surgery"
    assert {layer.name for layer in covered_layers(prepared)} == {"fc", "out"}
    y = torch.randn(3, 2, dtype=torch.float64)
    _check_psg(prepared, orig, x, y, ref=_loop_psg(orig, x, y))
    assert len(get_info(prepared).store.records[covered_layers(prepared)[0].spec.sites[0]]) == 2


# --------------------------------------------------------------------------- conv paddings
CONVS = {
    "2d_same_even_kernel": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=4, padding="same")),
    "2d_same_even_dilated": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=(2, 3),
                                             dilation=(3, 1), padding="same")),
    "2d_same_reflect_even": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=(4, 2),
                                             padding="same", padding_mode="reflect")),
    "2d_reflect": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=2,
                                   padding_mode="reflect")),
    "2d_circular_tuple": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=(1, 2),
                                          padding_mode="circular")),
    "2d_replicate": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=1,
                                     padding_mode="replicate")),
    "2d_stride_dilation": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=2,
                                           dilation=2, padding=(1, 3))),
    "2d_stride_tuple": (nn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=(3, 2),
                                        stride=(2, 3), padding=(0, 1))),
    "2d_groups": (nn.Conv2d, dict(in_channels=6, out_channels=9, kernel_size=3, padding=1, groups=3)),
    "2d_depthwise": (nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=3, groups=4, stride=2)),
    "2d_valid_nobias": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding="valid",
                                        bias=False)),
    "2d_1x1": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=1)),
    "1d": (nn.Conv1d, dict(in_channels=3, out_channels=4, kernel_size=5, stride=2, padding=2)),
    "1d_same_reflect_even": (nn.Conv1d, dict(in_channels=2, out_channels=3, kernel_size=4, padding="same",
                                             padding_mode="reflect")),
    "1d_groups_dilated_nobias": (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, dilation=2,
                                                 groups=2, bias=False)),
    "3d": (nn.Conv3d, dict(in_channels=2, out_channels=4, kernel_size=(3, 2, 3), stride=(1, 2, 1),
                           padding=(1, 0, 1), groups=2)),
    "3d_same_circular_even": (nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=2, padding="same",
                                              padding_mode="circular")),
    "3d_same_zeros_nobias": (nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=(2, 3, 4),
                                             padding="same", bias=False)),
}
SPATIAL = {nn.Conv1d: (11,), nn.Conv2d: (9, 8), nn.Conv3d: (5, 6, 4)}


class ConvNet(nn.Module):
    def __init__(self, cls, kw, spatial) -> None:
        super().__init__()
        self.conv = cls(**kw)
        with torch.no_grad():
            n = self.conv(torch.zeros(1, kw["in_channels"], *spatial)).numel()
        self.fc = nn.Linear(n, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize("case", list(CONVS))
def test_conv_per_sample_grads_every_padding(case: str) -> None:
    cls, kw = CONVS[case]
    spatial = SPATIAL[cls]
    torch.manual_seed(0)
    model = ConvNet(cls, kw, spatial).double()
    orig = copy.deepcopy(model)
    x = torch.randn(3, kw["in_channels"], *spatial, dtype=torch.float64)
    prepared = prepare(model, example_inputs=(x[:2],))
    assert {layer.name for layer in covered_layers(prepared)} == {"conv", "fc"}
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=1e-14)
    y = torch.randn(3, 3, dtype=torch.float64)
    _check_psg(prepared, orig, x, y, tol=1e-10)
    # batch gradient identical to the unprepared model's
    orig.zero_grad()
    _sq_loss(orig(x), y).backward()
    for (k, p), q in zip(prepared.named_parameters(), orig.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        prepare(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no nn\.Linear or nn\.Conv"):
        prepare(nn.Sequential(nn.BatchNorm1d(3), nn.ReLU()))
    with pytest.raises(ValueError, match="loss_reduction"):
        prepare(MLP(), loss_reduction="avg")  # type: ignore[arg-type]
    prepared = prepare(MLP(), example_inputs=(torch.randn(2, 6),))
    with pytest.raises(ValueError, match="already prepared"):
        prepare(prepared)
    surg = prepare(Untraceable(), example_inputs=(torch.randn(2, 6),))
    with pytest.raises(ValueError, match="already prepared"):
        prepare(surg, example_inputs=(torch.randn(2, 6),))
    plain = MLP()
    for fn in (covered_layers, tengrad_fx.report, get_info, capturing):
        with pytest.raises(ValueError, match=r"tengrad_fx\.prepare\(model\)"):
            fn(plain)
    with pytest.raises(TypeError, match="nn.Module"):
        get_info("model")  # type: ignore[arg-type]


def test_example_inputs_that_fail_raise_with_context() -> None:
    with pytest.raises(RuntimeError, match="example_inputs"):
        prepare(MLP(), example_inputs=(torch.randn(2, 5),))  # wrong feature size


# --------------------------------------------------------------------------- report
@pytest.mark.parametrize("cls", [CNN, TiedLM, Dual, WithSubclasses])
def test_report_lists_every_parameter(cls, capsys) -> None:
    torch.manual_seed(0)
    model = cls()
    ex = {CNN: torch.randn(2, 3, 8, 8), TiedLM: torch.randint(0, 11, (2, 4)),
          Dual: torch.randn(2, 6), WithSubclasses: torch.randn(2, 3, 5, 5)}[cls]
    prepared = prepare(model, example_inputs=(ex,))
    rep = tengrad_fx.report(prepared)
    print(rep)
    text = capsys.readouterr().out
    info = get_info(prepared)
    lines = text.splitlines()
    for k, _ in model.named_parameters():
        row = [ln for ln in lines if ln.split() and ln.split()[0] == k]
        assert len(row) == 1, k
        status = "covered" if k in info.covered else "fallback"
        assert row[0].split()[1] == status, row[0]
        if status == "fallback":
            assert info.fallback[k] in row[0]
    assert f"{rep.n_covered} covered, {rep.n_fallback} fallback" in text
    assert rep.n_covered + rep.n_fallback == len(list(model.parameters()))


# --------------------------------------------------------------------------- torch.compile
def _compile_case(backend: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    prepared = prepare(MLP(), example_inputs=(x[:2],))
    _sq_loss(prepared(x), y).backward()
    eager = [p.grad.clone() for p in prepared.parameters()]
    eager_psg = [layer.per_sample_grads()[0].clone() for layer in covered_layers(prepared)]
    prepared.zero_grad()
    get_info(prepared).store.clear()
    compiled = torch.compile(prepared, backend=backend)
    assert get_info(compiled) is get_info(prepared)
    _sq_loss(compiled(x), y).backward()
    for p, g in zip(prepared.parameters(), eager):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    store = get_info(prepared).store
    assert store.records, "compiled model captured nothing"
    for layer, ref in zip(covered_layers(compiled), eager_psg):
        torch.testing.assert_close(layer.per_sample_grads()[0], ref, rtol=1e-5, atol=1e-6)
    # a second step releases and re-records
    gen = store.generation
    _sq_loss(compiled(x), y).backward()
    assert store.generation == gen + 1 and _n_records(prepared) == 2


def test_torch_compile_aot_eager_records() -> None:
    _compile_case("aot_eager")


@pytest.mark.slow
def test_torch_compile_inductor_records() -> None:
    t = time.time()
    _compile_case("inductor")
    print(f"inductor compile case: {time.time() - t:.1f}s")
