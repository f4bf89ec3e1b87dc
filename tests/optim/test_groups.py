"""Stacked groups of equal-shape layers give dense block NGD on every step kind.

A float64 model with two equal 3→3 convolutions and two equal 6→6 Linears, so groups
hold two layers (``P`` groups under materialization, ``IG`` groups for factored
Linears, ``conv`` groups for factored convolutions and for convolutions materialized
beyond ``jacobian_budget_mb``: ``"materialize-nobudget"``, a budget of 0). ``curvature_every=2`` on batches
of 8 (curvature), 5 (reuse, a smaller last batch) and 8 (curvature): each step's update equals
``solve(JᵀJ/m + αI, g)`` per layer,
``J`` from ``torch.func`` per-sample gradients at the last curvature step's parameters
and batch (sampled labels for the MC Fisher), ``g`` the current full-batch gradient.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad.layer_groups import precondition
from testing.grouped_steps import check_steps_against_dense, float64_batches


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3, padding=1), nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 5 * 5, 6), nn.Tanh(),
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 4),
    ).double()


@pytest.mark.parametrize("strategy", ["auto", "factor", "materialize", "materialize-nobudget"])
@pytest.mark.parametrize("fisher,form", [("empirical", "auto"), ("empirical", "woodbury"), ("mc", "auto")])
def test_grouped_steps_equal_dense_block_ngd(strategy: str, fisher: str, form: str) -> None:
    net = _net()
    template = copy.deepcopy(net)
    batches = float64_batches((2, 5, 5), 4)
    model = tengrad_fx.prepare(net, example_inputs=(batches[0][0][:2],))
    alpha = 0.07
    budget = 0.0 if strategy.endswith("-nobudget") else 1024.0
    opt = TENGraD(model, lr=1.0, damping=alpha, momentum=0.0, curvature_every=2, fisher=fisher,
                  update_form=form, strategy=strategy.removesuffix("-nobudget"), kl_clip=None,
                  jacobian_budget_mb=budget)
    kinds = check_steps_against_dense(model, template, opt, batches, alpha, fisher,
                                      tengrad_fx.get_info(model).covered)
    assert kinds == [True, False, True]
    sizes = sorted(len(grp.layers) for grp in opt.curvature.groups)
    assert sizes[-1] >= 2, sizes  # two equal layers (or more, packed: group_build)
    forms = {(grp.form, grp.strategy if grp.form == "conv" else "", len(grp.layers)) for grp in opt.curvature.groups}
    if strategy in ("factor", "materialize-nobudget"):  # the two 3→3 convolutions: one stacked group
        assert ("conv", strategy.split("-")[0], 2) in forms, forms
    assert opt.counters == {"step": 3, "skipped": 0, "uncaptured": 0}


def test_gram_tf32_restores_the_matmul_setting_and_is_a_no_op_on_cpu() -> None:
    """``gram_tf32=True`` only switches CUDA fp32 matmuls to TF32 inside the Gram: on CPU
    the steps are bit-identical to the default, and the global setting is restored (also
    when the Gram raises)."""
    from tengrad_fx.optim.tengrad.layer_groups import tf32_matmuls

    mm = torch.backends.cuda.matmul
    read = (lambda: mm.fp32_precision) if hasattr(mm, "fp32_precision") else (lambda: mm.allow_tf32)
    before = read()
    with pytest.raises(RuntimeError, match="inside"):
        with tf32_matmuls(True):
            assert read() in ("tf32", True)
            raise RuntimeError("inside")
    assert read() == before
    out = []
    for tf32 in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        pm = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 6),))
        opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, gram_tf32=tf32)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            F.cross_entropy(pm(x), y).backward()
            opt.step()
        out.append([p.detach().clone() for p in pm.parameters()])
        assert read() == before
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("strategy", ["auto", "factor", "materialize"])
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_update_dot_equals_sum_of_u_times_g(strategy: str, fisher: str) -> None:
    """``precondition(..., dot=True)``'s ``Σ u·g`` (the KL clip's, from the
    ``m``-vectors: ``β‖g‖² + γ·cᵀ(J g)`` per layer) equals the sum over its updates, and its
    ``Σ‖g‖²`` that of their gradients, in
    float64, for the push-through and the Woodbury form and every group form: after a
    curvature step (``lr = 0``) the same batch again (its gradient is ``Jᵀ1/m``, so the
    empirical push-through probe holds) and another batch (it does not)."""
    net = _net()
    batches = float64_batches((2, 5, 5), 4)
    model = tengrad_fx.prepare(net, example_inputs=(batches[0][0][:2],))
    opt = TENGraD(model, lr=0.0, damping=0.07, curvature_every=10, fisher=fisher, strategy=strategy,
                  kl_clip=1e-3)
    seen_push = False
    for t, (x, y) in enumerate([batches[0], batches[0], batches[1]]):
        opt.zero_grad()
        out = model(x)
        if t == 0:
            opt.mc_capture(out)
        F.cross_entropy(out, y).backward()
        if t:
            for use_pt in (True, False):
                updates, dots = precondition(opt.curvature.groups, opt.curvature.chol, use_pt, 0.07, "mean",
                                                    dot=True)
                assert dots is not None
                ug, gsq = dots
                ref = sum((u * p.grad).sum() for p, u in updates.items())
                torch.testing.assert_close(ug, ref, rtol=1e-10, atol=1e-12)
                # Σ‖g‖² over the same parameters (what certifies their gradients finite)
                torch.testing.assert_close(gsq, sum((p.grad ** 2).sum() for p in updates), rtol=1e-12, atol=0.0)
            pushed = [grp.probe(*grp.grads(), 1.0 / x.shape[0]) for grp in opt.curvature.groups]
            seen_push |= bool(torch.cat(pushed).all())
        opt.step()
    assert seen_push == (fisher == "empirical")
    forms = {grp.form for grp in opt.curvature.groups}
    assert forms == {"materialize": {"P"}, "auto": {"P", "IG"}, "factor": {"IG", "conv"}}[strategy], forms


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_probe_samples_channels_and_still_sees_a_changed_gradient(monkeypatch, groups: int) -> None:
    """A ``"conv"`` stack wide enough to sample is probed on a few output channels of every
    group (one weight-gradient convolution over those channels, ``conv_stack.channel_sums``)
    instead of the full ``Jᵀ1``: True for the batch gradient itself, False once the gradient
    is not ``Jᵀ1/m`` — scaled as by clipping, or changed only in the bias."""
    from tengrad_fx.curvature import conv_stack
    from tengrad_fx.optim.tengrad import group_probe

    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1, groups=groups), nn.Tanh(),
                        nn.Conv2d(16, 16, 3, padding=1, groups=groups), nn.Tanh(),
                        nn.Conv2d(16, 16, 3, padding=1, groups=groups), nn.Tanh(), nn.Flatten(),
                        nn.Linear(16 * 4 * 4, 3)).double()
    x, y = torch.randn(6, 8, 4, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    pm = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, kl_clip=None, strategy="factor")
    F.cross_entropy(pm(x), y).backward()
    opt.step()
    conv = next(g for g in opt.curvature.groups if g.form == "conv" and len(g.layers) == 2)
    assert len(conv.layers) == 2
    calls = []
    real = conv_stack.channel_sums

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        out = real(*a, **k)
        calls.append(out[1].numel())
        return out

    monkeypatch.setattr(conv_stack, "channel_sums", spy)
    monkeypatch.setattr(group_probe, "PROBE_MIN_CHANNELS", 4)
    gw, gb = conv.grads()
    assert conv.probe(gw, gb, 1.0 / 6).tolist() == [True, True]
    # 16/g·9 coordinates per channel in each of g groups: ceil(256 / 144) = 2 channels per
    # group, at least PROBE_MIN_CHANNELS (4 here: 16/g = 8 channels per group when g = 2)
    assert calls == [4 * groups]
    assert conv.probe(gw * 0.999, gb, 1.0 / 6).tolist() == [False, False]
    gb2 = gb.clone()
    gb2[1, 0] += 1e-3 * gb.norm()
    assert conv.probe(gw, gb2, 1.0 / 6).tolist() == [True, False]
