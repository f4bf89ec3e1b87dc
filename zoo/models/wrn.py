"""Pre-activation Wide Residual Network for 32x32 inputs (Zagoruyko & Komodakis, 2016).

``WRN-d-k``: depth ``d = 6n + 4`` gives ``n`` basic blocks per stage; three stages of
widths ``16k, 32k, 64k`` after a 16-channel stem.  WRN-28-4: n = 4, widths
16 -> 64 -> 128 -> 256.

Shapes for N x in_chans x 32 x 32 input::

    stem   Conv3x3(in_chans, 16)               N x 16  x 32 x 32
    stage1 4 blocks, stride 1                  N x 64  x 32 x 32
    stage2 4 blocks, first stride 2            N x 128 x 16 x 16
    stage3 4 blocks, first stride 2            N x 256 x 8  x 8
    BN + ReLU + global avg pool + Flatten      N x 256
    Linear(256, num_classes)                   N x num_classes

Block (pre-activation): ``BN-ReLU-Conv3x3(stride)-BN-ReLU-[Dropout]-Conv3x3``.  When the
block changes width or stride the shortcut is a 1x1 convolution applied to the
*pre-activated* input (shared BN-ReLU), otherwise it is the identity on the raw input.

WRN-28-4 contains 25 3x3 convolutions (1 stem + 24 in blocks), 3 1x1 shortcut
convolutions (first block of each stage), 25 BatchNorm2d layers and 1 Linear; all
convolutions are bias-free.  Parameter count at ``num_classes=10``: 5,849,050.
"""

from __future__ import annotations

from torch import Tensor, nn

from ._init import init_cifar_weights

__all__ = ["WideBasicBlock", "WideResNet"]


class WideBasicBlock(nn.Module):
    """Pre-activation basic block: N x in_planes x H x W -> N x out_planes x H/s x W/s."""

    def __init__(self, in_planes: int, out_planes: int, stride: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_planes)
        self.relu1 = nn.ReLU()
        self.conv1 = nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_planes)
        self.relu2 = nn.ReLU()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = nn.Conv2d(out_planes, out_planes, 3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Conv2d | None = None
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        o = self.relu1(self.bn1(x))
        y = self.conv1(o)
        y = self.conv2(self.dropout(self.relu2(self.bn2(y))))
        if self.shortcut is not None:
            return y + self.shortcut(o)
        return y + x


class WideResNet(nn.Module):
    """CIFAR WideResNet-``depth``-``widen_factor`` (pre-activation).

    Args:
        depth: total depth, must satisfy ``(depth - 4) % 6 == 0``.
        widen_factor: channel multiplier ``k``.
        num_classes: output size.
        in_chans: input channels.
        dropout: dropout probability between the two convolutions of a block (0 = off).

    Input N x in_chans x H x W (32x32 for CIFAR) -> logits N x num_classes.
    """

    def __init__(
        self,
        depth: int = 28,
        widen_factor: int = 4,
        num_classes: int = 10,
        in_chans: int = 3,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if depth < 10 or (depth - 4) % 6 != 0:
            raise ValueError(f"WideResNet depth must be 6n+4 with n >= 1, got {depth}")
        n = (depth - 4) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        self.conv1 = nn.Conv2d(in_chans, widths[0], 3, stride=1, padding=1, bias=False)
        self.stage1 = self._stage(widths[0], widths[1], n, 1, dropout)
        self.stage2 = self._stage(widths[1], widths[2], n, 2, dropout)
        self.stage3 = self._stage(widths[2], widths[3], n, 2, dropout)
        self.bn = nn.BatchNorm2d(widths[3])
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(widths[3], num_classes)
        init_cifar_weights(self)

    @staticmethod
    def _stage(in_planes: int, out_planes: int, n: int, stride: int, dropout: float) -> nn.Sequential:
        blocks = [WideBasicBlock(in_planes, out_planes, stride, dropout)]
        blocks += [WideBasicBlock(out_planes, out_planes, 1, dropout) for _ in range(n - 1)]
        return nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        """``x``: N x in_chans x H x W -> logits N x num_classes."""
        x = self.stage3(self.stage2(self.stage1(self.conv1(x))))
        return self.fc(self.flatten(self.pool(self.relu(self.bn(x)))))
