"""A curvature step copies a new capture of the same layers into the last curvature's
stacks (:func:`tengrad_fx.optim.tengrad.group_build.build_groups` with ``reuse``): the same
groups, tensors and views, bit for bit the update of freshly made stacks, and fresh
stacks wherever the layers, shapes or parameters changed."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad import distribution as distribution_module
from tengrad_fx.utils.dispatch import OpCounter


def _net() -> nn.Module:
    """Packed small layers (norms, first conv), equal-shape convs and Linears (stacks)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 6 * 6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
        nn.Linear(12, 12), nn.ReLU(), nn.Linear(12, 5))


def _batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(m, 1, 6, 6, generator=g), torch.randint(0, 5, (m,), generator=g)) for m in sizes]


def _run(sizes: list[int], reuse: bool, monkeypatch: pytest.MonkeyPatch, strategy: str = "auto",
         swap_at: int = -1) -> tuple[list[torch.Tensor], list[list], list[list[int]]]:
    """Parameters after T=1 steps on batches of ``sizes``; per step the groups and the
    addresses of the copied (multi-layer or packed) stacks. ``reuse=False``: every
    curvature step makes new stacks."""
    if not reuse:
        monkeypatch.setattr(distribution_module, "previous_stacks", lambda groups: {})
    net = _net()
    data = _batches(sizes)
    pm = tengrad_fx.prepare(net, example_inputs=(data[0][0][:2],))
    opt = TENGraD(pm, lr=0.05, damping=0.1, momentum=0.9, weight_decay=1e-3, kl_clip=1e-2, strategy=strategy,
                  curvature_every=1)
    groups, ptrs = [], []
    for t, (x, y) in enumerate(data):
        if t == swap_at:  # a replaced Parameter (same shape and values)
            lin = pm.get_submodule("13")  # one of two stacked Linears
            lin.weight = nn.Parameter(lin.weight.detach().clone())
            opt.param_groups[0]["params"] = list(pm.parameters())
        opt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        opt.step()
        groups.append(list(opt.curvature.groups))
        ptrs.append([s.data_ptr() for grp in opt.curvature.groups if len(grp.layers) > 1 or grp.cols is not None
                     for s in grp.stacks() if s is not None])
    monkeypatch.undo()
    return [p.detach().clone() for p in pm.parameters()], groups, ptrs


@pytest.mark.parametrize("strategy", ["auto", "factor"])  # factor: the convs as a stacked "conv" group
def test_refilled_stacks_give_the_fresh_stacks_update_bit_for_bit(strategy: str, monkeypatch) -> None:
    sizes = [8, 8, 8, 8]
    ref, fresh, _ = _run(sizes, False, monkeypatch, strategy)
    got, groups, ptrs = _run(sizes, True, monkeypatch, strategy)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    forms = [(g.form, len(g.layers), g.cols is not None) for g in groups[0]]
    assert any(n > 1 and not packed for _, n, packed in forms), forms  # an equal-shape stack
    # auto: the small layers packed; factor: the convs stacked along the layer axis after the samples
    assert any(packed for _, _, packed in forms) if strategy == "auto" else ("conv", 2, False) in forms, forms
    for t in range(1, len(sizes)):
        assert ptrs[t] == ptrs[0]
        # every group with a copied stack is the same object (its views and buffers kept);
        # a single layer's stack stays a view of its new record (no copy)
        for a, b in zip(groups[0], groups[t]):
            assert (a is b) == (len(a.layers) > 1 or a.cols is not None), (a.form, len(a.layers))
    assert all(a is not b for a, b in zip(fresh[0], fresh[1]))


def test_new_batch_size_or_parameter_makes_new_stacks(monkeypatch) -> None:
    """A batch of another size, then a replaced Parameter: new stacks, and the updates
    still equal those of fresh stacks every step."""
    sizes = [8, 8, 6, 6, 6]
    ref, _, _ = _run(sizes, False, monkeypatch, swap_at=4)
    got, groups, _ = _run(sizes, True, monkeypatch, swap_at=4)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    kept = {id(g) for g in groups[0] if len(g.layers) > 1 or g.cols is not None}
    assert kept and kept <= {id(g) for g in groups[1]}
    assert not kept & {id(g) for g in groups[2]}  # m = 6: new stacks
    lin_groups = [g for g in groups[4] if any(lay.name == "13" for lay in g.layers)]
    assert lin_groups and all(g not in groups[3] for g in lin_groups)  # its Parameter was replaced


def test_refill_makes_no_stack_and_no_views(monkeypatch) -> None:
    """A T=1 step with refilled stacks dispatches fewer aten ops than with fresh ones: no
    zeros of the packed stack or of its kept gradient buffer, no views of either."""
    counts: dict[bool, OpCounter] = {}
    for reuse in (False, True):
        if not reuse:
            monkeypatch.setattr(distribution_module, "previous_stacks", lambda groups: {})
        net = _net()
        (x, y), = _batches([8])
        pm = tengrad_fx.prepare(net, example_inputs=(x[:2],))
        opt = TENGraD(pm, lr=0.05, damping=0.1, momentum=0.9, curvature_every=1)
        for i in range(3):
            opt.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            if i < 2:
                opt.step()
                continue
            with OpCounter() as oc:
                opt.step()
            counts[reuse] = oc
        monkeypatch.undo()
    fresh, refilled = counts[False], counts[True]
    zeros = "aten.new_zeros.default"
    assert fresh.ops[zeros] >= 2  # the packed stack and its gradient buffer
    assert refilled.ops[zeros] == fresh.ops[zeros] - 2
    assert refilled.total - refilled.kernels < fresh.total - fresh.kernels  # views
    assert refilled.total < fresh.total


@pytest.mark.parametrize("T", [1, 2])
def test_static_refill_with_cuda_graph_option_on_cpu_across_batch_sizes(T: int) -> None:
    """``cuda_graph=True`` on a CPU (the graph path, run eagerly): every group, single
    layers too, is refilled in place while the shapes stay, and a batch of another size
    makes new stacks and a new graph version; every step bit for bit the default path's."""
    def run(cuda_graph: bool) -> tuple[list[torch.Tensor], list[int], list[list[int]]]:
        net = _net()
        data = _batches([8, 8, 8, 6, 6, 8])
        pm = tengrad_fx.prepare(net, example_inputs=(data[0][0][:2],))
        opt = TENGraD(pm, lr=0.05, damping=0.1, momentum=0.9, weight_decay=1e-3, kl_clip=1e-2,
                      curvature_every=T, cuda_graph=cuda_graph)
        versions, ids = [], []
        for x, y in data:
            opt.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            opt.step()
            versions.append((opt.graph_runner.version + opt.curvature.version))
            ids.append([id(g) for g in opt.curvature.groups])
        return [p.detach().clone() for p in pm.parameters()], versions, ids

    ref, _, _ = run(False)
    got, versions, ids = run(True)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    if T == 1:  # curvature every step: the same groups (singles included) while m = 8, then m = 6
        assert ids[0] == ids[1] == ids[2] and ids[3] == ids[4] and not set(ids[2]) & set(ids[3])
        assert versions[0] == versions[1] == versions[2] < versions[3] == versions[4] < versions[5]
    else:
        assert versions[2] < versions[4]  # the curvature step at m = 6 (t = 4) re-versions
