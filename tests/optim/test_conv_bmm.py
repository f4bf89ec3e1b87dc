"""``"conv"`` stacks with few output positions per sample take ``J g`` and ``Jᵀ c`` by ``bmm``
(``curvature.conv_stack_bmm``): TENGraD's steps on a CNN down to 2×2 and 1×1 maps equal the
dense float64 NGD steps of ``testing.tengrad_step`` (curvature steps, reuse steps, and the
reuse steps after a second curvature step refilled the stacks and the ``bmm`` operands in
place), and a reuse step runs no convolution for those stacks.
"""
from __future__ import annotations

import pytest
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tengrad_fx.curvature import conv_stack_bmm
from tengrad_fx.optim.tengrad.group_forms import ConvStackGroup
from testing.tengrad_step import (
    assert_matches, batch, dense_u, forward_backward, full_grad, layer_params, setup, snapshot, step_delta,
)

M, ALPHA = 6, 0.05


def _conv_groups(opt) -> list[ConvStackGroup]:  # type: ignore[no-untyped-def]
    return [g for g in opt.curvature.groups if isinstance(g, ConvStackGroup)]


@pytest.mark.parametrize("cuda_graph", [False, True])
def test_steps_equal_dense_ngd_across_curvature_refills(cuda_graph: bool) -> None:
    """Steps 1, 3 take curvature (step 3's stacks refilled in place), 2, 4 reuse it."""
    template, model, opt = setup("cnn_small_maps", strategy="factor", curvature_every=2, cuda_graph=cuda_graph)
    layers = layer_params(model)
    kept = None
    for step in range(4):
        x, y = batch("cnn_small_maps", M, 10 + step)
        if step % 2 == 0:
            ref_curv, xc, yc = snapshot(template, model), x, y
        ref_now = snapshot(template, model)
        forward_backward(model, opt, x, y)
        g = full_grad(ref_now, x, y, F.cross_entropy)
        assert_matches(step_delta(model, opt), dense_u(ref_curv, xc, yc, F.cross_entropy, g, ALPHA, layers))
        groups = _conv_groups(opt)
        P = [g.B[0, 0, 0].numel() for g in groups]  # type: ignore[index]
        assert sorted(zip(P, (len(g.layers) for g in groups))) == [(1, 1), (4, 1), (4, 2), (16, 1)]
        ops = [g.bmm_operands() for g in groups]
        assert [o is not None for o in ops] == [p <= conv_stack_bmm.MAX_POSITIONS for p in P]
        if step == 1:
            # refilled: groups of several layers; with cuda_graph (static stacks) every group
            kept = [(g, o.U) for g, o in zip(groups, ops) if o is not None and (cuda_graph or len(g.layers) > 1)]
            assert len(kept) == (3 if cuda_graph else 1)
    assert kept is not None
    for g, U in kept:  # the group was refilled; its operands rewritten in place only where a graph reads them
        assert g in opt.curvature.groups and (g.bmm_operands().U is U) == cuda_graph  # type: ignore[union-attr]
    assert opt.curvature_steps == 2


def test_subsampled_curvature_on_small_maps_equals_dense_ngd() -> None:
    """``curvature_samples=3``: the ``bmm`` operands are made from the first 3 samples' stacks;
    a curvature step and a reuse step are ``(F_3 + αI)⁻¹ g`` with the whole batch's ``g``."""
    template, model, opt = setup("cnn_small_maps", strategy="factor", curvature_every=2, curvature_samples=3)
    layers = layer_params(model)
    for step in range(2):
        x, y = batch("cnn_small_maps", M, 20 + step)
        if step == 0:
            ref_curv, xc, yc = snapshot(template, model), x[:3], y[:3]
        ref_now = snapshot(template, model)
        forward_backward(model, opt, x, y)
        g = full_grad(ref_now, x, y, F.cross_entropy)
        assert_matches(step_delta(model, opt), dense_u(ref_curv, xc, yc, F.cross_entropy, g, ALPHA, layers))
        assert any(grp.bmm_operands() is not None for grp in _conv_groups(opt))


class _CountConvolutions(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = {"convolution": 0, "convolution_backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in self.calls:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def _reuse_step_convolutions(max_positions: int, monkeypatch) -> dict[str, int]:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(conv_stack_bmm, "MAX_POSITIONS", max_positions)
    _, model, opt = setup("cnn_small_maps", strategy="factor", curvature_every=100)
    for step in range(2):
        x, y = batch("cnn_small_maps", M, 20 + step)
        forward_backward(model, opt, x, y)
        if step == 0:
            opt.step()
    with _CountConvolutions() as count:
        opt.step()
    assert opt.curvature_steps == 1
    return count.calls


def test_reuse_step_runs_no_convolution_for_small_map_stacks(monkeypatch) -> None:
    """Four ``"conv"`` groups (16, 4, 4·2 layers, 1 positions): with the ``bmm`` form only
    the 16-position one runs its ``J g`` / ``Jᵀ c`` convolutions; without it, all four."""
    assert _reuse_step_convolutions(4, monkeypatch) == {"convolution": 1, "convolution_backward": 1}
    assert _reuse_step_convolutions(0, monkeypatch) == {"convolution": 4, "convolution_backward": 4}
