"""The eager fast path of the capture ops (:mod:`tengrad_fx.capture.eager`).

Outside ``torch.compile`` a captured forward + backward dispatches no ``tengrad_fx::`` op
(counted by a ``TorchDispatchMode``, which does see them on the custom-op path), and
records, gradients and running statistics are bit for bit those of the custom-op path
(the one ``torch.compile`` takes, forced here by ``FORCE_CUSTOM_OPS``): every capture
kind (Linear, Conv1d/2d with pre-padding, ConvTranspose2d, BatchNorm in train and eval
mode, GroupNorm, LayerNorm, torch/timm RMSNorm (affine), Embedding with ``padding_idx``,
an added parameter, a folded batch), with ``I, G`` records and with materialized ``P``,
in the MC pass (``grad_only``), under bf16 autocast, with and without an input gradient,
and with a frozen weight. The ``torch.func`` oracle tests of each kind run on the eager
path as well (it is the default).
"""
from __future__ import annotations

import copy
from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tengrad_fx
from tengrad_fx import get_info
from tengrad_fx.capture import eager

from testing.all_kinds import AllKinds, inputs
from .test_folds import Folded


class TengradOps(TorchDispatchMode):
    """Counts the ``tengrad_fx::*`` ops dispatched (custom ops reach a dispatch mode as
    one opaque op each)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.namespace == "tengrad_fx":
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def custom_ops(on: bool) -> Iterator[None]:
    was = eager.FORCE_CUSTOM_OPS
    eager.FORCE_CUSTOM_OPS = on
    try:
        yield
    finally:
        eager.FORCE_CUSTOM_OPS = was


def _model(kind: str, seed: int, dtype: torch.dtype) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    """A model with random parameters, an input batch of 5 and integer targets."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(100 + seed)
    if kind == "allkinds":
        net: nn.Module = AllKinds()
        x, idx = inputs(5, seed)
        xs: tuple[torch.Tensor, ...] = (x.to(dtype), idx)
    else:
        net = Folded("sample" if kind == "folded" else "patch")
        xs = (torch.randn(5, 3, 5, 3, generator=g, dtype=dtype),)
    net = net.to(dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=dtype))
    return net, xs, torch.randint(0, 3, (5,), generator=g)


def _pass(pm: nn.Module, xs: tuple[torch.Tensor, ...], y: torch.Tensor, *, mode: str,
          x_grad: bool) -> dict[str, Any]:
    """One captured forward + backward; everything it produced."""
    store = get_info(pm).store
    store.jacobian_sites = set(range(store.n_sites)) if mode == "materialized" else set()
    store.grad_only = mode == "grad_only"
    xs = tuple(x.detach().requires_grad_(x_grad) if x.is_floating_point() else x for x in xs)
    with TengradOps() as counter:
        with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
            out = pm(*xs)
        F.cross_entropy(out.float(), y).backward()
    store.grad_only = False
    return {"out": out, "ops": counter.ops, "records": store.records,
            "grads": {n: p.grad for n, p in pm.named_parameters()},
            "buffers": {n: b.clone() for n, b in pm.named_buffers()},
            "x_grad": [x.grad for x in xs if x.is_floating_point()]}


def _same(a: Any, b: Any, what: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), what
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    else:
        assert a == b, what


def _compare(fast: dict[str, Any], ref: dict[str, Any]) -> None:
    _same(fast["out"], ref["out"], "output")
    assert sorted(fast["records"]) == sorted(ref["records"]) and ref["records"]
    for site, recs in ref["records"].items():
        assert len(fast["records"][site]) == len(recs), site
        for r_fast, r_ref in zip(fast["records"][site], recs):
            for f in ("I", "G", "P", "Gsum", "in_shape"):
                _same(getattr(r_fast, f), getattr(r_ref, f), f"site {site} {f}")
    for n, g in ref["grads"].items():
        if g is None:
            assert fast["grads"][n] is None, n
        else:
            _same(fast["grads"][n], g, f"grad {n}")
    for n, b in ref["buffers"].items():
        _same(fast["buffers"][n], b, f"buffer {n}")
    for a, b in zip(fast["x_grad"], ref["x_grad"]):
        if b is None:
            assert a is None
        else:
            _same(a, b, "input grad")


MODES = ["records", "materialized", "grad_only", "autocast"]
CASES = [("allkinds", mode, True) for mode in MODES] + [
    ("allkinds", "records", False), ("allkinds", "materialized", False),  # BatchNorm in eval mode
    ("folded", "records", True), ("folded", "materialized", True), ("folded_patch", "grad_only", True)]


@pytest.mark.parametrize("kind,mode,train", CASES)
def test_eager_path_equals_custom_ops_and_dispatches_none(kind: str, mode: str, train: bool) -> None:
    dtype = torch.float32 if mode == "autocast" else torch.float64
    net, xs, y = _model(kind, seed=MODES.index(mode) + 10 * train, dtype=dtype)
    runs = {}
    for force in (True, False):  # two prepared copies of the same net, the same inputs
        pm = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=tuple(x[:2] for x in xs))
        assert tengrad_fx.report(pm).n_fallback == 0, tengrad_fx.report(pm)
        pm.train(train)
        with custom_ops(force):  # the input without, then with a gradient
            runs[force] = [_pass(pm, xs, y, mode=mode, x_grad=x_grad) for x_grad in (False, True)]
    for fast, ref in zip(runs[False], runs[True]):
        assert sum(ref["ops"].values()) > 0  # the counter sees the custom ops ...
        assert not fast["ops"], fast["ops"]  # ... and the eager path dispatches none
        _compare(fast, ref)
    assert runs[False][0]["x_grad"][0] is None and runs[False][1]["x_grad"][0] is not None


def test_frozen_weight_takes_the_plain_op_on_both_paths() -> None:
    """A frozen weight: the plain aten op, its trainable bias recorded alone by the bias
    site; a frozen bias (weight trained): still captured, no bias gradient."""
    net, xs, y = _model("allkinds", seed=3, dtype=torch.float64)
    net.conv.weight.requires_grad_(False)
    net.ln.weight.requires_grad_(False)
    net.bn.bias.requires_grad_(False)
    net.fc.bias.requires_grad_(False)
    runs = {}
    for force in (True, False):
        pm = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=tuple(x[:2] for x in xs))
        with custom_ops(force):
            runs[force] = _pass(pm, xs, y, mode="records", x_grad=True)
        layers = {layer.name: layer for layer in tengrad_fx.covered_layers(pm) if layer.captured}
        assert {"bn", "fc", "conv", "ln"} <= set(layers)
        assert layers["conv"].bias_only and layers["ln"].bias_only and not layers["fc"].bias_only
    ops = runs[True]["ops"]  # three convolutions in the model, two captured; no layer norm op
    assert ops["tengrad_fx.conv.default"] == 2 and ops["tengrad_fx.batch_norm.default"] == 1
    assert ops["tengrad_fx.bias_site.default"] == 2  # conv's and ln's bias
    assert not any("layer_norm" in op for op in ops)
    _compare(runs[False], runs[True])
    assert runs[False]["grads"]["bn.bias"] is None and runs[False]["grads"]["fc.weight"] is not None


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_tengrad_steps_equal_on_both_paths(fisher: str) -> None:
    """Three TENGraD steps (curvature, reuse, curvature; the MC pass included) give the
    same parameters bit for bit on the eager path and on the custom ops."""
    net, xs, y = _model("allkinds", seed=7, dtype=torch.float64)
    params = {}
    for force in (True, False):
        pm = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=tuple(x[:2] for x in xs))
        opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=2, fisher=fisher)
        torch.manual_seed(0)  # the MC labels
        with custom_ops(force):
            for it in range(3):
                opt.zero_grad()
                out = pm(xs[0] + 0.1 * it, xs[1])
                if fisher == "mc":
                    opt.mc_capture(out)
                F.cross_entropy(out, y).backward()
                opt.step()
        params[force] = torch.cat([p.detach().flatten() for p in pm.parameters()])
    assert torch.equal(params[False], params[True])
    assert not torch.equal(params[False], torch.cat([p.detach().flatten() for p in net.parameters()]))
