"""Capture off (or no grad): a prepared model is the plain model, op for op.

The FX path runs the plain graph then (:mod:`tengrad_fx.capture.plain_graph`), the surgery path
its wrappers' plain branches. Machine-independent facts, counted with a
``TorchDispatchMode``: the forward + backward dispatches exactly the aten ops of the
unprepared model, in the same order, with bit-identical outputs, parameter and input
gradients and buffers — in train and eval mode, for every capture kind (convolution
with pre-padding, transposed convolution, Conv1d, BatchNorm, GroupNorm, LayerNorm,
RMSNorm, embedding, an added parameter, a functional F.linear, multi-head attention, a
model whose train and eval graphs differ) and for a model prepared by module surgery.
The capturing path still records after a capture-off forward.
"""
from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tengrad_fx
from tengrad_fx import get_info

from testing.all_kinds import AllKinds, inputs
from ._helpers import Untraceable


class OpLog(TorchDispatchMode):
    """The aten ops dispatched, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


class FunctionalLinear(nn.Linear):
    """A Linear whose own forward is traced through (its ``F.linear`` is rewritten)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight, self.bias))


class AttnDual(nn.Module):
    """Multi-head attention, a functional ``F.linear`` (a traced-through Linear), BatchNorm1d,
    and a forward that differs between train and eval (two graphs)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = FunctionalLinear(3, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # [m, 5, 8]
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = self.bn(h.mean(1))
        if self.training:
            h = h * 0.5
        return self.head(h)


def _case(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "allkinds":
        x, idx = inputs(4, 1)
        return AllKinds().double(), (x.double(), idx), torch.randint(0, 5, (4,), generator=g)
    if kind == "attn_dual":
        return AttnDual(), (torch.randn(4, 5, 3, generator=g),), torch.randint(0, 4, (4,), generator=g)
    return Untraceable(), (torch.randn(4, 6, generator=g),), torch.randint(0, 3, (4,), generator=g)


def _run(net: nn.Module, xs: tuple[torch.Tensor, ...], y: torch.Tensor, grad: bool) -> dict[str, Any]:
    xs = tuple(x.detach().requires_grad_(grad) if x.is_floating_point() else x for x in xs)
    for p in net.parameters():
        p.grad = None
    with OpLog() as log, torch.set_grad_enabled(grad):
        out = net(*xs)
        if grad:
            F.cross_entropy(out.float(), y).backward()
    return {"ops": log.ops, "out": out.detach(),
            "grads": [p.grad for p in net.parameters()],
            "x_grads": [x.grad for x in xs if x.is_floating_point()],
            "buffers": [b.clone() for b in net.buffers()]}


def _same(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all((u is None and v is None) or (u is not None and v is not None and torch.equal(u, v))
                                    for u, v in zip(a, b))


@pytest.mark.parametrize("kind", ["allkinds", "attn_dual", "surgery"])
@pytest.mark.parametrize("train", [True, False])
def test_capture_off_dispatches_the_plain_models_ops(kind: str, train: bool) -> None:
    net, xs, y = _case(kind)
    pm = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=tuple(x[:2] for x in xs))
    assert get_info(pm).method == {"allkinds": "fx", "attn_dual": "fx-dual", "surgery": "surgery"}[kind]
    assert tengrad_fx.report(pm).n_fallback == 0, tengrad_fx.report(pm)
    net.train(train)
    pm.train(train)
    for grad, off in ((True, True), (False, True), (False, False)):  # no grad: plain even with capture on
        with tengrad_fx.capturing(pm, not off):
            ref, got = _run(net, xs, y, grad), _run(pm, xs, y, grad)
        assert got["ops"] == ref["ops"] and ref["ops"], (grad, off)
        assert torch.equal(got["out"], ref["out"])
        for what in ("grads", "x_grads", "buffers"):
            assert _same(got[what], ref[what]), what
        assert not any(get_info(pm).store.records.values())
    got = _run(pm, xs, y, True)  # capture on again: the capturing graph records
    assert got["ops"] != ref["ops"] and get_info(pm).store.records


def _tengrad_calls(fn: Any) -> set[str]:
    """The tengrad_fx functions (``module.name``) Python calls while running ``fn()``."""
    seen: set[str] = set()

    def prof(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call" and "tengrad_fx" in frame.f_code.co_filename:
            seen.add(f"{frame.f_globals.get('__name__')}.{frame.f_code.co_name}")
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


@pytest.mark.parametrize("kind", ["allkinds", "attn_dual"])
def test_capture_off_runs_no_capture_wrapper(kind: str) -> None:
    """FX path, capture off: the plain graph, no Python wrapper per layer call (only the
    forward's dispatch and :func:`~tengrad_fx.capture.plain_graph.layer_forward`); capture on:
    the wrappers."""
    net, xs, y = _case(kind)
    pm = tengrad_fx.prepare(net, example_inputs=tuple(x[:2] for x in xs))
    with tengrad_fx.capturing(pm, False):
        off = _tengrad_calls(lambda: F.cross_entropy(pm(*xs), y).backward())
    on = _tengrad_calls(lambda: F.cross_entropy(pm(*xs), y).backward())
    plain = "tengrad_fx.capture.plain_graph"
    assert off == {f"{plain}.forward", f"{plain}.layer_forward"}, off
    assert "tengrad_fx.capture.ops.linear" in on and f"{plain}.layer_forward" not in on


def test_covered_layer_hooks_run_in_neither_mode() -> None:
    """The plain graph calls a covered layer's forward, not the module: its hooks run
    neither with capture on nor off (as before, the capture graph never called it)."""
    net, xs, _ = _case("allkinds")
    pm = tengrad_fx.prepare(net, example_inputs=tuple(x[:2] for x in xs))
    calls: list[str] = []
    handle = pm.get_submodule("fc").register_forward_hook(lambda *a: calls.append("fc"))
    try:
        for on in (True, False):
            with tengrad_fx.capturing(pm, on):
                pm(*xs)
    finally:
        handle.remove()
    assert calls == []
