"""Operations a TENGraD step dispatches do not grow with depth.

Counted with ``tengrad_fx.utils.dispatch.OpCounter`` around ``opt.step()`` (warmed up). ``kernels``
are the non-view aten ops (the ones that launch device work). Models: WRN-28-1 against
its shallow equivalent WRN-10-1, which has the same layer shapes (groups) with one block
per stage instead of four (28 covered layers against 10, 25 BatchNorms against 7).

Bound reached (CPU, torch 2.14.1): with every layer materialized (``strategy=
"materialize"``: all layers in stacked ``P`` groups) the deep model's step launches at
most 1.02× the kernels of the shallow one, on curvature and on reuse steps (the
difference is the ``stack`` of groups with several layers). With ``strategy="auto"``
at these tiny sizes the cost model factors the last stage's convolutions; they are
stacked too (``"conv"`` groups, :mod:`tengrad_fx.curvature.conv_stack`; its 2 × 2 maps take
``J g`` and ``Jᵀ c`` by ``bmm``, :mod:`tengrad_fx.curvature.conv_stack_bmm`), and the
16-channel convolutions keep ``J`` (``jacobian_sites.default_jacobian_cap``) in packed groups.
Measured: 316 / 304 and 203 / 191 kernels on empirical / MC curvature steps (1.039 /
1.063), 98 / 96 on reuse steps (1.021): the deep step's extra kernels are the ``stack`` of
the groups of several layers and two reshape copies of their factored Grams. Bound 1.07×.
With ``strategy="factor"`` every BatchNorm is factored too, and norm layers by factor
still go one layer at a time (25 against 7): 2.34 / 2.32 / 2.36× (it was 2.96× before the
conv stacks; the fused final update, ``update._fused_momentum_step``, took 15 kernels off
every step of both models, and the KL clip from the ``m``-vectors and one finiteness check
a few more, so the same per-layer ops weigh more in the ratio: reuse 629 against 267
kernels). With ``"materialize"`` both models' steps are now the same kernels (96 / 70 /
43: every layer in one packed group).
The bound asked of this test is ≤ 4×.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.utils.dispatch import OpCounter
from tengrad_fx.zoo.models.wrn import WideResNet
from testing.grouped_steps import step_counts


@pytest.fixture(scope="module")
def prepared() -> dict[int, torch.nn.Module]:
    torch.manual_seed(0)
    x = torch.randn(2, 1, 8, 8)
    return {d: tengrad_fx.prepare(WideResNet(depth=d, widen_factor=1, num_classes=5, in_chans=1),
                                  example_inputs=(x,)) for d in (10, 28)}


def _kernels_per_step(pm: torch.nn.Module, strategy: str, T: int, fisher: str) -> dict[str, int]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    opt = tengrad_fx.TENGraD(pm, lr=0.01, damping=0.1, momentum=0.9, weight_decay=1e-3,
                             kl_clip=1e-3, curvature_every=T, fisher=fisher, strategy=strategy)
    return {kind: counts[0] for kind, counts in step_counts(pm, opt, x, y).items()}  # last (warmed-up) step


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("strategy,bound", [("materialize", 1.03), ("auto", 1.07), ("factor", 2.4)])
def test_deep_step_dispatches_about_what_shallow_does(prepared, fisher: str, strategy: str, bound: float) -> None:
    shallow = _kernels_per_step(prepared[10], strategy, 2, fisher)
    deep = _kernels_per_step(prepared[28], strategy, 2, fisher)
    assert set(deep) == {"curvature", "reuse"}
    for kind in deep:
        ratio = deep[kind] / shallow[kind]
        assert ratio <= bound, (kind, deep[kind], shallow[kind], ratio)
    assert deep["reuse"] < deep["curvature"]


def test_reuse_step_forms_u_inside_the_gemm(prepared) -> None:
    """On a reuse step of stacked ``P`` groups, ``u = g/α − (k/α)·Pᵀc`` is one ``baddbmm``
    per parameter stack (and ``J g`` one per stack): no separate ``bmm``/``sub``/``div``
    pass over ``[L, n]`` (each was a kernel per group on the GPU)."""
    pm = prepared[10]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 1, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    opt = tengrad_fx.TENGraD(pm, lr=0.01, damping=0.1, curvature_every=10, strategy="materialize")
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        with OpCounter() as oc:
            opt.step()
    groups = len(opt.curvature.groups)
    ops = {str(k): v for k, v in oc.ops.items()}
    assert ops.get("aten.bmm.default", 0) == 0 and ops.get("aten.div.Tensor", 0) == 0, ops
    assert ops.get("aten.sub.Tensor", 0) == 0, ops
    # J g (weight + bias) and u (weight + bias) per group
    assert ops["aten.baddbmm.default"] <= 4 * groups, (ops["aten.baddbmm.default"], groups)


def test_curvature_work_of_a_3c1f_shape_is_a_handful_of_kernels() -> None:
    """The curvature part of a T=1 step on a 3C1F-shaped model (three convolutions in one
    packed ``P`` group, two factored Linears): building the groups, their Grams and ONE
    factorization (every jitter try in one batched ``cholesky_ex``) dispatch 28 kernels
    (59 before: four ``cholesky_ex`` with a ``where`` chain, the scale ``k²`` as a pass of
    its own, a copy of the factors without a CUDA graph); the push-through probe 6 per
    packed group and 15 per factored Linear (7 and 18 before)."""
    import torch.nn as nn

    torch.manual_seed(0)
    c = 4
    net = nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
                        nn.Linear(4 * 4 * c, 20), nn.ReLU(), nn.Linear(20, 5))
    x, y = torch.randn(8, 1, 12, 12), torch.randint(0, 5, (8,))
    pm = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=0.01, damping=0.1, curvature_every=1, kl_clip=None)
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        opt.step()
    opt.zero_grad()
    F.cross_entropy(pm(x), y).backward()
    with OpCounter() as oc:
        opt._refresh(0.1)
    assert [(g.form, len(g.layers), g.cols is not None) for g in opt.curvature.groups] == \
        [("P", 3, True), ("IG", 1, False), ("IG", 1, False)]
    assert oc.ops["aten.linalg_cholesky_ex.default"] == 1, oc.ops
    assert oc.kernels <= 28, dict(oc.ops)
    for grp, bound in zip(opt.curvature.groups, (6, 15, 15)):
        gw, gb = grp.grads()
        with OpCounter() as oc:
            ok = grp.probe(gw, gb, 1.0 / x.shape[0])
        assert oc.kernels <= bound, (grp.form, dict(oc.ops))
        assert bool(ok.all())  # the plain loss: g is the batch's Jᵀ1/m
