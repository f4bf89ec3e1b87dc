"""DenseNet-BC for 32x32 inputs (Huang et al., 2017): bottleneck layers + compression 0.5.

Depth mapping.  A DenseNet-BC with three dense blocks of ``n`` bottleneck layers has
``6n + 4`` weighted layers (two convolutions per bottleneck layer, the stem convolution,
two transition convolutions and the classifier).  Depth 19 is not of that form:
``(19 - 4) / 6 = 2.5``.  We follow the reference implementations, which compute
``n = (depth - 4) / 3`` and halve it for bottlenecks with truncation, i.e.
``n = (depth - 4) // 6``; ``densenet-19`` therefore has **2 bottleneck layers per
dense block** (16 weighted layers in practice: 15 convolutions + 1 Linear).

With growth rate ``k = 100`` (stem width ``2k = 200``, compression 0.5), the shapes for
N x in_chans x 32 x 32 input are::

    stem   Conv3x3(in_chans, 200)                 N x 200 x 32 x 32
    block1 2 x (+100 channels, concatenated)      N x 400 x 32 x 32
    trans1 BN-ReLU-Conv1x1(400, 200)-AvgPool2     N x 200 x 16 x 16
    block2                                        N x 400 x 16 x 16
    trans2 BN-ReLU-Conv1x1(400, 200)-AvgPool2     N x 200 x 8 x 8
    block3                                        N x 400 x 8 x 8
    BN + ReLU + global avg pool + Flatten         N x 400
    Linear(400, num_classes)                      N x num_classes

Bottleneck layer: ``BN-ReLU-Conv1x1(C, 4k)-BN-ReLU-Conv3x3(4k, k)``, output concatenated
to its input along channels.  Convolutions are bias-free, dropout is not used.
Parameter count at ``num_classes=10``: 2,939,610.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._init import init_cifar_weights

__all__ = ["Bottleneck", "DenseNetBC", "Transition"]


class Bottleneck(nn.Module):
    """N x C x H x W -> N x (C + growth) x H x W (input concatenated with new features)."""

    def __init__(self, in_planes: int, growth_rate: int) -> None:
        super().__init__()
        inter = 4 * growth_rate
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_planes, inter, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(inter)
        self.relu2 = nn.ReLU()
        self.conv2 = nn.Conv2d(inter, growth_rate, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.conv1(self.relu1(self.bn1(x)))
        y = self.conv2(self.relu2(self.bn2(y)))
        return torch.cat([x, y], dim=1)


class Transition(nn.Module):
    """N x C_in x H x W -> N x C_out x H/2 x W/2 via BN-ReLU-Conv1x1-AvgPool2d(2)."""

    def __init__(self, in_planes: int, out_planes: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(in_planes)
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_planes, out_planes, 1, bias=False)
        self.pool = nn.AvgPool2d(2)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(self.conv(self.relu(self.bn(x))))


class DenseNetBC(nn.Module):
    """CIFAR DenseNet-BC with three dense blocks of ``(depth - 4) // 6`` bottleneck layers.

    Args:
        depth: nominal depth; layers per block = ``(depth - 4) // 6`` (>= 1).
        growth_rate: channels added by each bottleneck layer (``k``).
        reduction: transition compression factor (0.5 for "-BC").
        num_classes: output size.
        in_chans: input channels.

    Input N x in_chans x H x W (32x32 for CIFAR) -> logits N x num_classes.
    """

    def __init__(
        self,
        depth: int = 19,
        growth_rate: int = 100,
        reduction: float = 0.5,
        num_classes: int = 10,
        in_chans: int = 3,
    ) -> None:
        super().__init__()
        n = (depth - 4) // 6
        if n < 1:
            raise ValueError(f"DenseNet-BC depth must be >= 10, got {depth}")
        self.layers_per_block = n
        planes = 2 * growth_rate
        self.conv1 = nn.Conv2d(in_chans, planes, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        for i in range(3):
            block = nn.Sequential(*[Bottleneck(planes + j * growth_rate, growth_rate) for j in range(n)])
            stages.append(block)
            planes += n * growth_rate
            if i < 2:
                out_planes = int(planes * reduction)
                stages.append(Transition(planes, out_planes))
                planes = out_planes
        self.block1, self.trans1, self.block2, self.trans2, self.block3 = stages
        self.bn = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(planes, num_classes)
        self.num_features = planes
        init_cifar_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: N x in_chans x H x W -> logits N x num_classes."""
        x = self.conv1(x)
        x = self.trans1(self.block1(x))
        x = self.trans2(self.block2(x))
        x = self.block3(x)
        return self.fc(self.flatten(self.pool(self.relu(self.bn(x)))))
