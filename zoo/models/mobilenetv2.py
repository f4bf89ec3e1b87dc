"""MobileNetV2 for 32x32 inputs (Sandler et al., 2018; the widely used CIFAR variant).

CIFAR changes from the ImageNet model: stem convolution stride 1 and stride 1 in the
second stage (``(6, 24, 2, 1)``), so the 32x32 input is downsampled only three times
(32 -> 16 -> 8 -> 4).  Activations are ``nn.ReLU``.

Stage config ``(expansion t, out_planes c, num_blocks n, first stride s)``::

    (1, 16, 1, 1) (6, 24, 2, 1) (6, 32, 3, 2) (6, 64, 4, 2)
    (6, 96, 3, 1) (6, 160, 3, 2) (6, 320, 1, 1)

Shapes for N x in_chans x 32 x 32 input::

    stem  Conv3x3(in_chans, 32, s=1)-BN-ReLU      N x 32   x 32 x 32
    17 inverted-residual blocks                   N x 320  x 4  x 4
    Conv1x1(320, 1280)-BN-ReLU                    N x 1280 x 4  x 4
    global avg pool + Flatten                     N x 1280
    Linear(1280, num_classes)                     N x num_classes

Block: ``Conv1x1(C, tC)-BN-ReLU -> depthwise Conv3x3(tC, tC, groups=tC, stride s)-BN-ReLU
-> Conv1x1(tC, C_out)-BN``.  Every block has the expansion 1x1 convolution, including
``t = 1``.  Stride-1 blocks add a residual: identity when ``C == C_out``, otherwise a
``Conv1x1-BN`` projection; stride-2 blocks have no residual.  The 17 depthwise
convolutions are true depthwise (``groups == in_channels == out_channels``).
Convolutions are bias-free.  Parameter count at ``num_classes=10``: 2,296,922.
"""

from __future__ import annotations

from torch import Tensor, nn

from ._init import init_cifar_weights

__all__ = ["CIFAR_CFG", "InvertedResidual", "MobileNetV2"]

CIFAR_CFG: tuple[tuple[int, int, int, int], ...] = (
    (1, 16, 1, 1),
    (6, 24, 2, 1),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class InvertedResidual(nn.Module):
    """N x in_planes x H x W -> N x out_planes x H/stride x W/stride."""

    def __init__(self, in_planes: int, out_planes: int, expansion: int, stride: int) -> None:
        super().__init__()
        planes = expansion * in_planes
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, groups=planes, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu2 = nn.ReLU()
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_planes)
        self.use_residual = stride == 1
        self.shortcut: nn.Sequential | None = None
        if stride == 1 and in_planes != out_planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, bias=False),
                nn.BatchNorm2d(out_planes),
            )

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu1(self.bn1(self.conv1(x)))
        y = self.relu2(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        if not self.use_residual:
            return y
        if self.shortcut is not None:
            return y + self.shortcut(x)
        return y + x


class MobileNetV2(nn.Module):
    """CIFAR MobileNetV2.

    Args:
        num_classes: output size.
        in_chans: input channels.
        cfg: stage config ``(expansion, out_planes, num_blocks, first_stride)``.

    Input N x in_chans x H x W (32x32 for CIFAR) -> logits N x num_classes.
    """

    def __init__(
        self,
        num_classes: int = 10,
        in_chans: int = 3,
        cfg: tuple[tuple[int, int, int, int], ...] = CIFAR_CFG,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_chans, 32, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(32)
        self.relu1 = nn.ReLU()
        blocks: list[nn.Module] = []
        in_planes = 32
        for expansion, out_planes, num_blocks, stride in cfg:
            for i in range(num_blocks):
                blocks.append(InvertedResidual(in_planes, out_planes, expansion, stride if i == 0 else 1))
                in_planes = out_planes
        self.layers = nn.Sequential(*blocks)
        self.conv2 = nn.Conv2d(in_planes, 1280, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(1280)
        self.relu2 = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(1280, num_classes)
        init_cifar_weights(self)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: N x in_chans x H x W -> logits N x num_classes."""
        x = self.relu1(self.bn1(self.conv1(x)))
        x = self.layers(x)
        x = self.relu2(self.bn2(self.conv2(x)))
        return self.fc(self.flatten(self.pool(x)))
