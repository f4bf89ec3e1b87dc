"""What TENGraD keeps between steps and its transient during ``opt.step()``, in tensor bytes.

Machine-independent (``tengrad_fx.utils.memory``: unique storages; live storages op by op). Model: a
small convnet whose layers fall on both sides of the default rule
(``jacobian_sites.default_jacobian_cap``: ``J`` kept when at most ``min(4, S/8)`` times its
``I, G``): the 3-channel and 8-channel convolutions at 16×16 and the strided one have ``J``
within it (kept as stacked ``P``), the 64-channel ones at 8×8 (``J`` 4.5× their ``I, G``)
and the Linear (one position: 1×) beyond it (kept as ``I, G``: a ``"conv"`` stack of two and
an ``"IG"`` group).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.curvature import conv_stack
from tengrad_fx.optim.tengrad import group_build, layer_groups
from tengrad_fx.utils.memory import LiveBytes, kept_tensors, tensor_bytes

M = 32


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 64, 10))


def _io_bytes(net: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, int, float]]:
    """Per Conv/Linear of the plain model: ``(J bytes m·n·4, I + G bytes, the default cap)``
    measured on its forward (input and output sizes, G has the output's; the cap is the
    ``I, G`` bytes × ``min(4, S/8)``, at least 1×, ``S`` the output positions)."""
    sizes: dict[str, tuple[int, int, float]] = {}

    def record(name: str, mod: nn.Module, inp: tuple, out: torch.Tensor) -> None:
        S = out[0, 0].numel() if isinstance(mod, nn.Conv2d) else 1
        ig = (inp[0].numel() + out.numel()) * 4
        sizes[name] = (x.shape[0] * sum(p.numel() for p in mod.parameters()) * 4, ig, min(4.0, max(1.0, S / 8)) * ig)

    hooks = [mod.register_forward_hook(lambda mod, inp, out, name=name: record(name, mod, inp, out))
             for name, mod in net.named_modules() if isinstance(mod, (nn.Conv2d, nn.Linear))]
    net(x)
    for h in hooks:
        h.remove()
    return sizes


def _setup(budget=None, T: int = 10):
    torch.manual_seed(0)
    net = _net()
    x, y = torch.randn(M, 3, 16, 16), torch.randint(0, 10, (M,))
    sizes = _io_bytes(net, x)
    pm = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=0.01, damping=0.1, curvature_every=T, kl_clip=None, jacobian_budget_mb=budget)
    return pm, opt, x, y, sizes


def _step(pm, opt, x, y) -> LiveBytes:
    opt.zero_grad()
    F.cross_entropy(pm(x), y).backward()
    with LiveBytes(kept_tensors(opt)) as lb:  # records of this capture + the last curvature's stacks
        opt.step()
    return lb


def _padding(groups) -> int:
    """Zero columns of packed ``"P"`` groups (small layers side by side, ``group_build``):
    at most ``PACK_MAX_BYTES`` each."""
    pad = 0
    for g in groups:
        if g.cols is not None:
            pad += g.Pw.numel() * g.Pw.element_size() - sum(M * (a + b) * 4 for a, b in g.cols)
            assert pad <= group_build.PACK_MAX_BYTES
    return pad


def _small_tensors(opt) -> int:
    """Grams, factors and flags: ``[L, m, m]`` twice per layer, some slack."""
    return 2 * len(opt._layers) * M * M * 8 + 4096


def test_kept_between_steps_is_at_most_each_layers_smaller_form() -> None:
    """After a curvature step, the optimizer and store keep no more than, per layer, its
    ``J`` where that is within the default cap, else its ``I, G`` (plus Grams, factors and
    the zero columns of packed small layers): a kept oversized ``J`` or a
    second copy of a stack (records not pointed at it) would exceed it. The flat budget
    of 1 GiB (the old default) keeps every ``J`` and exceeds it on this model."""
    pm, opt, x, y, sizes = _setup()
    for _ in range(2):
        _step(pm, opt, x, y)
    kept = tensor_bytes(kept_tensors(opt))
    bound = sum(j if j <= cap else ig for j, ig, cap in sizes.values()) + _small_tensors(opt) \
        + _padding(opt.curvature.groups)
    assert kept <= bound, (kept, bound)
    assert {g.form for g in opt.curvature.groups} == {"P", "conv", "IG"}
    pm, opt, x, y, _ = _setup(budget=1024)
    _step(pm, opt, x, y)
    assert tensor_bytes(kept_tensors(opt)) > bound


def _stack_bytes(opt) -> int:
    return tensor_bytes([t for g in opt.curvature.groups for t in g.stacks() if t is not None])


@pytest.mark.parametrize("T", [1, 10])
def test_step_transient_is_one_layers_jacobian_and_vectors(T: int, monkeypatch) -> None:
    """The live tensor bytes during ``opt.step()`` exceed what the step needs on entry
    (this capture's records; on reuse steps the cached stacks) by at most one layer's
    per-sample gradients made by the Gram of a ``"conv"`` stack (with aten's weight-shaped
    placeholder of the same size: 2·J), parameter-sized vectors (g, u, the update),
    Grams, and the packed group of the small layers (made new, ``group_build``). T=1: the last curvature's
    stacks are freed before the new ones are made (they were alive until the end of the step: 1.8 MB over
    the bound here)."""
    monkeypatch.setattr(conv_stack, "STACK_BLOCK_FLOOR", 0)  # its rule at these small sizes
    pm, opt, x, y, sizes = _setup(T=T)
    params = sum(p.numel() * 4 for p in pm.parameters())
    big_j = max(j for name, (j, _, cap) in sizes.items() if j > cap and name != "13")  # a 64-channel conv (13: Linear)
    bound = 2 * big_j + 4 * params + _small_tensors(opt)
    for i in range(3):
        old = _stack_bytes(opt) if T == 1 else 0  # not needed by a curvature step
        lb = _step(pm, opt, x, y)
        packed = tensor_bytes([g.Pw for g in opt.curvature.groups if g.cols is not None])  # made new by packing
        assert lb.peak - (lb.start - old) <= bound + packed, (i, lb.peak - lb.start + old, bound, packed)


def test_stacking_transient_is_bounded_by_stack_bytes(monkeypatch) -> None:
    """Stacking a group holds its records and its stack together while it is made: the
    transient of ``build_groups`` is the largest stack, bounded by
    ``group_build.STACK_BYTES`` (layers beyond it stay views of their records: no
    copy, no transient), and no stack outlives the step besides the records' views."""
    pm, opt, x, y, _ = _setup(T=1)

    def build(limit: int) -> tuple[int, list[layer_groups.LayerGroup]]:
        monkeypatch.setattr(group_build, "STACK_BYTES", limit)
        monkeypatch.setattr(group_build, "PACK_MAX_BYTES", min(limit, group_build.PACK_MAX_BYTES))
        opt.curvature.groups, opt.curvature.K = [], []
        opt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        with LiveBytes(kept_tensors(opt)) as lb:
            groups, _ = group_build.build_groups(opt._layers, "auto", None)
        assert lb.end <= lb.start + _padding(groups)  # the records view the stacks: nothing kept twice
        return lb.peak - lb.start, groups

    extra, groups = build(2**40)
    largest = max(_stack_bytes_of(g) for g in groups)
    assert largest > 0 and extra >= largest, (extra, largest)
    extra, groups = build(0)
    assert all(len(g.layers) == 1 for g in groups)
    assert extra <= 4096, extra


def _stack_bytes_of(g) -> int:
    """The largest single stack of a group (its stacks are made one after the other)."""
    return max(tensor_bytes([t]) for t in g.stacks() if t is not None) if len(g.layers) > 1 else 0
