"""Coverage table of ``prepare`` on the model zoo: tensors and parameters (by count)
covered exactly, and the reasons of the fallbacks.

    python -m tools.coverage [--slow] [--markdown]

The fast set is the 14 models of ``tests/capture/test_models.py``; ``--slow`` adds the
heavier ones. Each model is prepared with ``example_inputs`` (batch-2/3 probe) at the
input size the tests use.
"""
from __future__ import annotations

import argparse
from collections import Counter
from typing import Callable

import torch
import torch.nn as nn

import tengrad_fx


def _tv(name: str, **kw) -> Callable[[], nn.Module]:  # type: ignore[no-untyped-def]
    import torchvision

    return lambda: getattr(torchvision.models, name)(weights=None, num_classes=10, **kw)


def _timm(name: str, **kw) -> Callable[[], nn.Module]:  # type: ignore[no-untyped-def]
    import timm

    return lambda: timm.create_model(name, pretrained=False, num_classes=10, **kw)


def _resnext_tiny() -> nn.Module:
    from torchvision.models.resnet import Bottleneck, ResNet

    return ResNet(Bottleneck, [1, 1, 1, 1], groups=8, width_per_group=8, num_classes=10)


def _densenet_small() -> nn.Module:
    from torchvision.models.densenet import DenseNet

    return DenseNet(growth_rate=12, block_config=(2, 2, 2), num_init_features=16, num_classes=10)


def _tv_vit_small() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


# name -> (build, input size, input channels)
FAST: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "tv resnet18": (_tv("resnet18"), 32, 3),
    "tv resnext (g=8)": (_resnext_tiny, 32, 3),
    "timm regnetx_002": (_timm("regnetx_002"), 32, 3),
    "tv mobilenet_v2": (_tv("mobilenet_v2"), 32, 3),
    "timm efficientnet_b0": (_timm("efficientnet_b0"), 32, 3),
    "tv densenet (small)": (_densenet_small, 32, 3),
    "timm convnext_atto": (_timm("convnext_atto"), 32, 3),
    "timm vit_tiny (img 32)": (_timm("vit_tiny_patch16_224", img_size=32), 32, 3),
    "tv googlenet with aux heads": (_tv("googlenet", aux_logits=True, init_weights=False), 64, 3),
    "tv mobilenet_v3_small": (_tv("mobilenet_v3_small"), 32, 3),
    "tv squeezenet1_1": (_tv("squeezenet1_1"), 32, 3),
    "tv shufflenet_v2_x0_5": (_tv("shufflenet_v2_x0_5"), 32, 3),
    "timm resnet18 in_chans=1": (_timm("resnet18", in_chans=1), 32, 1),
    "timm tf_mobilenetv3_small_minimal": (_timm("tf_mobilenetv3_small_minimal_100"), 32, 3),
}
SLOW: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "tv densenet121": (_tv("densenet121"), 32, 3),
    "tv resnext50_32x4d": (_tv("resnext50_32x4d"), 32, 3),
    "tv regnet_y_400mf": (_tv("regnet_y_400mf"), 32, 3),
    "tv inception_v3 with aux heads": (_tv("inception_v3", aux_logits=True, init_weights=False), 299, 3),
    "tv vgg11": (_tv("vgg11"), 32, 3),
    "timm swin_tiny (img 64, window 4)": (_timm("swin_tiny_patch4_window7_224", img_size=64, window_size=4), 64, 3),
    "timm mobilevit_xxs (img 64)": (_timm("mobilevit_xxs"), 64, 3),
    "tv vit (2 layers, d=32; nn.MultiheadAttention)": (_tv_vit_small, 32, 3),
}


def coverage_row(name: str, build: Callable[[], nn.Module], size: int, chans: int) -> tuple[str, ...]:
    """``(model, covered/fallback tensors, % by count, fallback reasons)``."""
    torch.manual_seed(0)
    model = tengrad_fx.prepare(build(), example_inputs=(torch.randn(2, chans, size, size),))
    rep = tengrad_fx.report(model)
    reasons = Counter(why.split(" (")[0] for why in rep.fallbacks.values())
    note = "; ".join(f"{n}× {why}" for why, n in reasons.most_common())
    return (name, f"{rep.n_covered} / {rep.n_fallback}", f"{100 * rep.fraction_params:.2f} %",
            f"{100 * rep.fraction_tensors:.1f} %", note)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow", action="store_true", help="also the heavier models")
    args = ap.parse_args(argv)
    cases = dict(FAST, **(SLOW if args.slow else {}))
    print("| model | covered / fallback tensors | by parameter count | by tensors | fallback reasons |")
    print("|---|---|---|---|---|")
    for name, (build, size, chans) in cases.items():
        print("| " + " | ".join(coverage_row(name, build, size, chans)) + " |", flush=True)


if __name__ == "__main__":
    main()
