"""Packed ``"P"`` groups (:mod:`tengrad_fx.optim.tengrad.group_build`): small materialized layers of
different widths (norm layers' ``γ, β``, small convolutions and Linears, with and without a
bias) share one zero-padded stack, and the update stays exact, the store's records stay
each layer's own ``P`` / ``Gsum``, and the norm layers cost no kernels over the
Linear/Conv-only step.

Exactness: a float64 eval-mode model (BatchNorm with fixed running statistics: exact
per-sample gradients) with ``curvature_every=2`` on batches of 8 (curvature), 5 (reuse) and
8 (curvature): each step's update equals ``solve(JᵀJ/m + αI, g)`` per layer, ``J`` from
``torch.func`` per-sample gradients at the last curvature step (sampled labels for the MC
Fisher), ``g`` the current gradient — also when ``g`` has a term outside ``J`` (a penalty
on the norm weights: the push-through probe of the packed group must fail for those
layers only).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad.layer_groups import pack
from tengrad_fx.zoo.bench_models import build_model
from testing.grouped_steps import check_steps_against_dense, float64_batches, step_counts


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Tanh(),
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6), nn.LayerNorm(6, bias=False), nn.Tanh(), nn.Linear(6, 4),
    ).double().eval()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        net[1].running_mean.normal_()
        net[1].running_var.uniform_(0.5, 1.5)
        for i in (1, 4, 8):
            net[i].weight.normal_()
    return net


def _penalty(model: nn.Module) -> torch.Tensor:
    """A loss term outside the captured ``J``: on the norm weights only."""
    return 0.3 * sum((model.get_parameter(f"{i}.weight") ** 2).sum() for i in (1, 8))  # type: ignore[return-value]


@pytest.mark.parametrize("strategy", ["auto", "materialize"])
@pytest.mark.parametrize("fisher,form,penalty", [("empirical", "auto", False), ("empirical", "auto", True),
                                                 ("empirical", "woodbury", False), ("mc", "auto", False)])
def test_packed_groups_equal_dense_block_ngd(strategy: str, fisher: str, form: str, penalty: bool) -> None:
    net = _net()
    template = copy.deepcopy(net)
    batches = float64_batches((2, 4, 4), 4)
    model = tengrad_fx.prepare(net, example_inputs=(batches[0][0][:2],))
    model.eval()
    info = tengrad_fx.get_info(model)
    assert not info.fallback, info.fallback
    alpha = 0.07
    opt = TENGraD(model, lr=1.0, damping=alpha, momentum=0.0, curvature_every=2, fisher=fisher,
                  update_form=form, strategy=strategy, kl_clip=None)

    def probe_first_step(t: int, x: torch.Tensor) -> None:  # which layers took push-through
        if t != 0 or fisher != "empirical" or form != "auto":
            return
        packed = next(grp for grp in opt.curvature.groups if grp.cols is not None)
        ok = packed.probe(*packed.grads(), 1.0 / x.shape[0])
        penalized = torch.tensor([lay.name in ("1", "8") for lay in packed.layers])
        assert torch.equal(ok, ~penalized if penalty else torch.ones_like(penalized)), (ok, penalized)

    kinds = check_steps_against_dense(model, template, opt, batches, alpha, fisher, info.covered,
                                      _penalty if penalty else None, probe_first_step)
    assert kinds == [True, False, True]
    packed = [grp for grp in opt.curvature.groups if grp.cols is not None]
    assert len(packed) == 1, [(grp.form, [lay.name for lay in grp.layers]) for grp in opt.curvature.groups]
    grp = packed[0]
    layer_kinds = {lay.kind for lay in grp.layers}
    assert {"batchnorm", "groupnorm", "layernorm"} <= layer_kinds, layer_kinds
    widths = {sum(c) for c in grp.cols}  # type: ignore[union-attr]
    assert len(widths) > 1 and any(nb == 0 for _, nb in grp.cols) and any(nb > 0 for _, nb in grp.cols)
    assert grp.Pb is None and grp.Pw is not None and grp.Pw.shape[2] == max(widths)
    for i, lay in enumerate(grp.layers):  # the records are views of the unpadded part of the stack
        r = lay.records()[0]
        n_w, n_b = grp.cols[i]  # type: ignore[index]
        if r.P is None:
            continue
        assert r.P.shape == (8, n_w) and r.P.untyped_storage().data_ptr() == grp.Pw.untyped_storage().data_ptr()
        assert torch.equal(grp.Pw[i, :, n_w + n_b:], torch.zeros_like(grp.Pw[i, :, n_w + n_b:]))
        if n_b:
            assert r.Gsum is not None and r.Gsum.shape == (8, n_b)
            assert torch.equal(r.Gsum, grp.Pw[i, :, n_w: n_w + n_b])
    assert opt.counters == {"step": 3, "skipped": 0, "uncaptured": 0}
    # the packed gradient: the group's kept buffer (every gradient present) = a fresh pack,
    # padding still zero after three steps; without one gradient, fresh zeros in its place
    pairs = grp.param_pairs()
    fresh = pack([[p.grad.reshape(-1) for p in pair if p is not None] for pair in pairs], grp.Pw.shape[2], grp.Pw)
    kept = grp.grads()[0]
    assert torch.equal(kept, fresh) and kept is grp.grads()[0]
    w0 = pairs[0][0]
    g0, w0.grad = w0.grad, None
    without = grp.grads()[0]
    assert torch.equal(without[0, :w0.numel()], torch.zeros(w0.numel(), dtype=without.dtype))
    assert torch.equal(without[:, w0.numel():], fresh[:, w0.numel():]) and without is not kept
    w0.grad = g0


NORM_EXTRA_KERNELS = 0
NORM_EXTRA_OPS = 100


def _counts(only_linear_conv: bool, fisher: str) -> dict[str, tuple[int, int, int]]:
    """``{step kind: (kernels, all ops, syncs)}`` of a warmed-up TENGraD step on tiny-bn."""
    torch.manual_seed(0)
    base, shape = build_model("tiny-bn")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, *shape, generator=g), torch.randint(0, 10, (16,), generator=g)
    model = tengrad_fx.prepare(base, example_inputs=(x[:2],), only_linear_conv=only_linear_conv)
    opt = TENGraD(model, lr=0.01, damping=0.1, curvature_every=2, fisher=fisher, kl_clip=0.01)
    return step_counts(model, opt, x, y)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_norm_layers_add_no_kernels_to_the_step(fisher: str) -> None:
    """tiny-bn (three BatchNorm2d, one BatchNorm1d) with every parameter preconditioned
    against ``prepare(only_linear_conv=True)``: the norm layers join the packed group of
    the small convolutions, so a warmed-up step launches no more kernels
    (``NORM_EXTRA_KERNELS``; before packing: +70 on an empirical curvature step, 331 vs 261)
    and dispatches at most ``NORM_EXTRA_OPS`` more ops in all (views and slices of the
    packed stacks; measured +88 / +56 on curvature / reuse steps); 0 host syncs."""
    full, linconv = _counts(False, fisher), _counts(True, fisher)
    assert set(full) == set(linconv) == {"curvature", "reuse"}
    for kind in full:
        (k_full, o_full, s_full), (k_lc, o_lc, s_lc) = full[kind], linconv[kind]
        assert k_full <= k_lc + NORM_EXTRA_KERNELS, (kind, k_full, k_lc)
        assert o_full <= o_lc + NORM_EXTRA_OPS, (kind, o_full, o_lc)
        assert s_full == s_lc == 0, (kind, s_full, s_lc)
