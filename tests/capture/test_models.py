"""``prepare`` on real timm / torchvision architectures.

For every model: the prepared module computes the original's outputs and parameter
gradients, holds the very same Parameter objects under the same ``state_dict`` keys,
covers every Linear/Conv/norm layer that is called as an ordinary layer (the rest are fallbacks
with a reason), and the captured ``(I, G)`` of each covered layer reproduce exactly that
layer's batch gradient. For ResNet-18 and a ViT, per-sample gradients of every covered
layer are compared with ``torch.func`` in float64.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torchvision.models.densenet import DenseNet
from torchvision.models.resnet import Bottleneck, ResNet

import tengrad_fx
from tengrad_fx.capture.match import match_module
from tengrad_fx.capture.norm import NORM_KINDS
from tengrad_fx.curvature import norm as norm_kernel
from testing import per_sample_grads_reference

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_BASES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class Case:
    build: Callable[[], nn.Module]
    size: int = 32  # input H = W
    in_chans: int = 3
    method: str = "fx"
    # parameter-name substrings that may legitimately be Linear/Conv fallbacks
    expect_fallback: tuple[str, ...] = ()
    # ordinary layers whose input folds another axis into the batch (-> sample-dim fallback)
    folded: tuple[str, ...] = ()


def _tv(name: str, **kw) -> Callable[[], nn.Module]:
    return lambda: getattr(torchvision.models, name)(weights=None, num_classes=10, **kw)


def _timm(name: str, **kw) -> Callable[[], nn.Module]:
    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw)


CASES: dict[str, Case] = {
    "tv_resnet18": Case(_tv("resnet18")),
    # torchvision's ResNeXt class (groups=8, width 8 per group), shallow to stay cheap
    "tv_resnext_tiny": Case(lambda: ResNet(Bottleneck, [1, 1, 1, 1], groups=8, width_per_group=8,
                                           num_classes=10)),
    "timm_regnetx_002": Case(_timm("regnetx_002")),  # grouped convs, timm BatchNormAct2d leaves
    "tv_mobilenet_v2": Case(_tv("mobilenet_v2")),  # depthwise
    "timm_efficientnet_b0": Case(_timm("efficientnet_b0")),  # depthwise + SE convs
    "tv_densenet_small": Case(lambda: DenseNet(growth_rate=12, block_config=(2, 2, 2),
                                               num_init_features=16, num_classes=10)),
    "timm_convnext_atto": Case(_timm("convnext_atto")),  # Linear on channels-last maps
    "timm_vit_tiny": Case(_timm("vit_tiny_patch16_224", img_size=32)),  # Linear on sequences
    # train-mode output has aux heads -> two graphs; dropout in train mode
    "tv_googlenet_aux": Case(_tv("googlenet", aux_logits=True, init_weights=False), size=64,
                             method="fx-dual"),
    "tv_mobilenet_v3_small": Case(_tv("mobilenet_v3_small")),
    "tv_squeezenet1_1": Case(_tv("squeezenet1_1")),
    "tv_shufflenet_v2_x0_5": Case(_tv("shufflenet_v2_x0_5")),  # channel shuffle (view/transpose)
    "timm_resnet18_1ch": Case(_timm("resnet18", in_chans=1), in_chans=1),
    # TF 'same' padding: Conv2dSame pads at run time, then an unpadded conv (covered)
    "timm_tf_mobilenetv3_small_minimal": Case(_timm("tf_mobilenetv3_small_minimal_100")),
}

SLOW_CASES: dict[str, Case] = {
    "tv_densenet121": Case(_tv("densenet121")),
    "tv_resnext50_32x4d": Case(_tv("resnext50_32x4d")),
    "tv_regnet_y_400mf": Case(_tv("regnet_y_400mf")),
    "tv_inception_v3_aux": Case(_tv("inception_v3", aux_logits=True, init_weights=False), size=299,
                                method="fx-dual"),
    "tv_vgg11": Case(_tv("vgg11")),
    # tensor constants made by the tracer (relative position index); drop path -> two graphs;
    # windows folded into the batch (B·nW, Wt, C): attention qkv/proj covered by the fold probe
    "timm_swin_tiny": Case(_timm("swin_tiny_patch4_window7_224", img_size=64, window_size=4), size=64,
                           method="fx-dual"),
    # MobileVitBlock traced (unfold/fold as graph leaves); transformer rows (B·P, N, D) folded
    "timm_mobilevit_xxs": Case(_timm("mobilevit_xxs"), size=64),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _outputs(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def _loss(out, y) -> torch.Tensor:
    outs = _outputs(out)
    return F.cross_entropy(outs[0], y) + 0.3 * sum(F.cross_entropy(o, y) for o in outs[1:])


def _ordinary_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Linear/Conv modules whose forward is the base layer's, and norm layers with affine
    parameters (what prepare must cover)."""
    return {n: m for n, m in model.named_modules() if match_module(m)[0]}


def _grads_from_records(spec, store) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``Σ_sites Σ_positions Gᵀ I`` from the captured records: the layer's batch gradient."""
    W, b = spec.weight, spec.bias
    gw = torch.zeros_like(W)
    gb = torch.zeros_like(b) if b is not None else None
    n = 0
    for site in spec.sites:
        for rec in store.records.get(site, []):
            n += 1
            if rec.I is None:  # materialized per-sample gradients
                gw += rec.P.sum(0).view(W.shape)
                if gb is not None:
                    gb += rec.Gsum.sum(0)
                continue
            I, G = rec.I, rec.G
            if spec.kind in NORM_KINDS:
                dW, db = norm_kernel.per_sample_grads(spec, I, G)
                gw += dW.sum(0).view(W.shape)
                if gb is not None:
                    gb += db.sum(0)
            elif spec.kind == "linear":
                assert I.shape[-1] == W.shape[1] and G.shape[-1] == W.shape[0]
                gw += G.reshape(-1, G.shape[-1]).T @ I.reshape(-1, I.shape[-1])
                if gb is not None:
                    gb += G.reshape(-1, G.shape[-1]).sum(0)
            else:
                nd = W.dim() - 2
                assert I.shape[1] == W.shape[1] * spec.groups and G.shape[1] == W.shape[0]
                _, w, bb = torch.ops.aten.convolution_backward(
                    G, I, W, [W.shape[0]] if b is not None else None, list(spec.stride),
                    list(spec.padding), list(spec.dilation), False, [0] * nd, spec.groups,
                    [False, True, b is not None])
                gw += w
                if gb is not None:
                    gb += bb
    assert n >= 1, f"layer {spec.name}: nothing captured"
    return gw, gb


def _check_model(name: str, case: Case) -> None:
    torch.manual_seed(0)
    # float64: with batch norm over m=3 samples (1x1 maps at the end) float32 gradients of
    # these nets are ill-conditioned (≈10% off the float64 ones for the original model
    # itself), so a float32 comparison could not tell a bug from rounding
    model = case.build().double()
    ref = copy.deepcopy(model)  # untouched original (its BN running stats evolve in step with ours)
    orig_params = dict(model.named_parameters())
    orig_keys = list(model.state_dict().keys())
    m = 3
    x = torch.randn(m, case.in_chans, case.size, case.size, dtype=torch.float64)
    y = torch.tensor([1, 7, 3])

    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert info.method == case.method, info.trace_error

    # (c) same Parameter objects, same state_dict keys (same order)
    assert list(prepared.state_dict().keys()) == orig_keys
    prep_params = dict(prepared.named_parameters())
    assert prep_params.keys() == orig_params.keys()
    for k, p in prep_params.items():
        assert p is orig_params[k], k
    for k, bf in dict(model.named_buffers()).items():
        assert dict(prepared.named_buffers())[k] is bf, k

    # (a) + (b): train mode (BN batch stats, dropout under the same seed), capture on
    prepared.train()
    ref.train()
    torch.manual_seed(1)
    out_p = prepared(x)
    torch.manual_seed(1)
    out_r = ref(x)
    assert type(out_p) is type(out_r)
    for a, b in zip(_outputs(out_p), _outputs(out_r), strict=True):
        assert a.shape == b.shape
        assert _rel(a, b) <= 1e-5
    _loss(out_p, y).backward()
    _loss(out_r, y).backward()
    ref_params = dict(ref.named_parameters())
    for k, p in prep_params.items():
        pr = ref_params[k]
        assert (p.grad is None) == (pr.grad is None), k
        if pr.grad is not None:
            assert _rel(p.grad, pr.grad) <= 1e-5 or (p.grad - pr.grad).abs().max() <= 1e-7, k
    prep_buffers = dict(prepared.named_buffers())
    for k, b2 in ref.named_buffers():
        b1 = prep_buffers[k]
        if b1.is_floating_point():
            assert _rel(b1, b2) <= 1e-5 or (b1 - b2).abs().max() <= 1e-7, k  # BN running stats

    # eval mode outputs (the eval graph for fx-dual)
    prepared.eval()
    ref.eval()
    with torch.no_grad():
        for a, b in zip(_outputs(prepared(x)), _outputs(ref(x)), strict=True):
            assert _rel(a, b) <= 1e-5

    # (d) coverage: every ordinary Linear/Conv covered; everything else a fallback with a reason
    assert set(info.covered) | set(info.fallback) == set(orig_params)
    assert not set(info.covered) & set(info.fallback)
    for why in info.fallback.values():
        assert isinstance(why, str) and why.strip()
    ordinary = _ordinary_layers(ref)
    folded = {n for n in ordinary if any(s in n for s in case.folded) and n + ".weight" not in info.covered}
    assert not case.folded or folded
    for n in folded:
        assert "does not index samples" in info.fallback[n + ".weight"], n
    ordinary = {n: mod for n, mod in ordinary.items() if n not in folded}
    missing = [f"{n}.weight: {info.fallback.get(n + '.weight')}" for n in ordinary
               if n + ".weight" not in info.covered]
    assert not missing, missing
    for n, mod in ref.named_modules():
        if isinstance(mod, _BASES) and n not in ordinary and n not in folded:
            assert any(s in n for s in case.expect_fallback), n
            assert info.fallback[n + ".weight"]
    layers = tengrad_fx.covered_layers(prepared)
    assert {layer.name for layer in layers if layer.kind != "param"} == set(ordinary)
    rep = tengrad_fx.report(prepared)
    n_cov, n_fb = len(info.covered), len(info.fallback)
    assert (rep.n_covered, rep.n_fallback) == (n_cov, n_fb)
    # the coverage target: ≥ 99 % of the parameters (by count) preconditioned exactly; a model
    # below it names the reason (windows folded into the batch)
    assert rep.fraction_params >= 0.99 or case.folded, (rep.fraction_params, rep.fallbacks)
    n_lin_fb = sum(1 for n, mod in ref.named_modules() if isinstance(mod, _BASES) and n not in ordinary)
    assert n_lin_fb == len(folded) + sum(1 for n, mod in ref.named_modules()
                                         if isinstance(mod, _BASES) and not match_module(mod)[0])
    print(f"\n{name}: covered {n_cov} / fallback {n_fb} params "
          f"({len(layers)} layers, {n_lin_fb} Linear/Conv fallback layers, method {info.method})")

    # the captured (I, G) reproduce each covered layer's batch gradient
    for layer in layers:
        spec = layer.spec
        gw, gb = _grads_from_records(spec, info.store)
        assert _rel(gw, spec.weight.grad) <= 1e-4, spec.name
        if gb is not None:
            assert _rel(gb, spec.bias.grad) <= 1e-4 or (gb - spec.bias.grad).abs().max() <= 1e-7, spec.name
        for site in spec.sites:
            for rec in info.store.records.get(site, []):
                assert rec.m == m, spec.name


@pytest.mark.parametrize("name", list(CASES))
def test_prepare_model(name: str) -> None:
    _check_model(name, CASES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_prepare_model_heavy(name: str) -> None:
    _check_model(name, SLOW_CASES[name])


# --------------------------------------------------------------------------- per-sample
PSG = {
    "tv_resnet18": (CASES["tv_resnet18"].build, 32),
    "timm_vit_tiny": (CASES["timm_vit_tiny"].build, 32),
}


@pytest.mark.parametrize("name", list(PSG))
def test_per_sample_grads_match_torch_func(name: str) -> None:
    """Eval mode, float64: every covered layer's per-sample gradients equal vmap(grad)."""
    build, size = PSG[name]
    torch.manual_seed(0)
    model = build().double().eval()
    orig = copy.deepcopy(model)
    m = 3
    x = torch.randn(m, 3, size, size, dtype=torch.float64)
    y = torch.tensor([2, 5, 9])
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    prepared.eval()  # eval() must not switch capture off
    F.cross_entropy(prepared(x), y).backward()
    ref = per_sample_grads_reference(orig, x, F.cross_entropy, y)
    layers = tengrad_fx.covered_layers(prepared)
    assert len([la for la in layers if la.kind != "param"]) == len(_ordinary_layers(orig))
    pnames = {id(p): k for k, p in prepared.named_parameters()}
    for layer in layers:
        dW, db = layer.per_sample_grads()
        wn = pnames[id(layer.weight)]
        assert dW.shape == ref[wn].shape
        assert _rel(dW, ref[wn]) <= 1e-8, wn
        if layer.bias is not None:
            bn = pnames[id(layer.bias)]
            assert _rel(db, ref[bn]) <= 1e-8, bn
