"""Shared weight initialisation for the CIFAR models."""

from __future__ import annotations

from torch import nn

__all__ = ["init_cifar_weights"]


def init_cifar_weights(model: nn.Module) -> None:
    """Kaiming-normal (fan_out, ReLU) convolutions, unit/zero BatchNorm, zero Linear bias.

    Linear weights keep PyTorch's default initialisation.
    """
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
