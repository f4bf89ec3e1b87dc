"""The benchmark models: 3C1F and its narrower, batch-normed variants on 1×28×28 inputs,
and the zoo's CIFAR models on 3×32×32 (10 classes each), by name."""
from __future__ import annotations

from torch import nn

from .models import MLPMixer
from .registry import get_model

__all__ = ["FMNIST_MODELS", "MODEL_NAMES", "ZOO_MODELS", "build_model"]

ZOO_MODELS = ("wrn-28-4", "densenet-19", "mobilenetv2")
FMNIST_MODELS = ("resnet18", "mixer")
MODEL_NAMES = ("3c1f", "small", "tiny", "3c1f-bn", "small-bn", "tiny-bn", *FMNIST_MODELS, *ZOO_MODELS)


def build_model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """``(model, input shape)``. ``3c1f``: the paper's model (Conv 1→128→128→128,
    MaxPool 3, Linear 10368→500→10); ``small``/``tiny``: the same with 32/8 channels;
    ``-bn``: a BatchNorm2d after each conv and a BatchNorm1d after the first Linear;
    ``resnet18``: torchvision's ResNet-18 with a one-channel first convolution (1×28×28);
    ``mixer``: :class:`~.models.MLPMixer` (patches 4×4, width 128, depth 4; 1×28×28);
    ``wrn-28-4``, ``densenet-19``, ``mobilenetv2``: the zoo's CIFAR models (3×32×32)."""
    if name == "resnet18":
        return get_model("torchvision:resnet18", num_classes=10, in_chans=1), (1, 28, 28)
    if name == "mixer":
        return MLPMixer(num_classes=10), (1, 28, 28)
    if name in ZOO_MODELS:
        return get_model(name, num_classes=10), (3, 32, 32)
    c = {"3c1f": 128, "small": 32, "tiny": 8}[name.removesuffix("-bn")]
    bn = name.endswith("-bn")
    norm2 = (lambda: nn.BatchNorm2d(c)) if bn else nn.Identity
    return nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1), norm2(), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), norm2(), nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1), norm2(), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
        nn.Linear(9 * 9 * c, 500), nn.BatchNorm1d(500) if bn else nn.Identity(), nn.ReLU(), nn.Linear(500, 10),
    ), (1, 28, 28)
