"""Models of the FSDP2 tests with layers of their own row cuts, built by
:func:`testing.fsdp_workers.make_model`: "mlp-extras", layers recorded as per-sample gradients
only: an added parameter ``pos [1, 6]`` (a learned offset of the input, covered by
``prepare``'s surgery: :mod:`tengrad_fx.capture.added_params`; ``fully_shard`` gives its one
row to one rank) and a bias-only layer (``fc2``'s weight frozen), around the polar tests' MLP
(batches of :func:`testing.fsdp_polar.batch`); "cnn-grouped", grouped convolutions (2 groups
of 2 output channels: whole groups on each of 2 ranks; a depthwise one), the CNN's batches;
"tconv", transposed convolutions (:class:`TransposedCNN`), the CNN's batches; "cnn-split",
grouped convolutions whose groups 2 ranks' rows split (:class:`SplitGroupsCNN`), the CNN's batches.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .fsdp_polar import MLP

__all__ = ["ExtrasMLP", "GroupedCNN", "TransposedCNN", "SplitGroupsCNN"]


class ExtrasMLP(MLP):
    """:class:`~testing.fsdp_polar.MLP` on ``x + pos``, ``fc2.weight`` frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(0.1 * torch.randn(1, 6))
        self.fc2.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.pos)


class GroupedCNN(nn.Module):
    """``[m, 3, 6, 6]`` → Conv 3→6 → tanh → Conv 6→4 (2 groups, stride 2) → relu → depthwise
    Conv 4→4 → Linear 16→3."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1)
        self.c2 = nn.Conv2d(6, 4, 3, stride=2, groups=2)
        self.c3 = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.c2(torch.tanh(self.c1(x))))
        return self.fc(torch.tanh(self.c3(x)).flatten(1))


class TransposedCNN(nn.Module):
    """``[m, 3, 6, 6]`` → ConvTranspose 3→5 (3 input-channel rows: uneven shards, ``[0, 2)`` and
    ``[2, 3)`` on 2 ranks; its bias's 5 rows ``[0, 3)``, ``[3, 5)``) → tanh → Conv 5→3 (stride 2)
    → tanh → ConvTranspose 3→6 (3 groups of 1 input channel, stride 2, output_padding 1: a
    rank's groups' output channels ``[0, 4)`` or ``[4, 6)``, its bias rows ``[0, 3)`` or
    ``[3, 6)``) → tanh → ConvTranspose 6→4 (2 groups, one per rank of 2) → tanh → 3×3 average
    pool → Linear 16→3."""

    def __init__(self) -> None:
        super().__init__()
        self.t0 = nn.ConvTranspose2d(3, 5, 3, padding=1)
        self.c1 = nn.Conv2d(5, 3, 3, stride=2)
        self.t1 = nn.ConvTranspose2d(3, 6, 3, stride=2, output_padding=1, groups=3)
        self.t2 = nn.ConvTranspose2d(6, 4, 3, padding=1, groups=2)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.t1(torch.tanh(self.c1(torch.tanh(self.t0(x))))))
        return self.fc(F.avg_pool2d(torch.tanh(self.t2(x)), 3).flatten(1))


class SplitGroupsCNN(nn.Module):
    """``[m, 3, 6, 6]`` → Conv 3→6 (3 groups of 2 output channels: on 2 ranks rows ``[0, 3)``,
    group 0 and half of group 1, and ``[3, 6)``) → tanh → ConvTranspose 6→3 (3 groups of 2 input
    channels, stride 2, output_padding 1: split alike; its bias rows ``[0, 2)``, ``[2, 3)``) →
    tanh → Conv 3→4 (stride 3) → Linear 64→3."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 6, 3, padding=1, groups=3)
        self.t1 = nn.ConvTranspose2d(6, 3, 3, stride=2, padding=1, output_padding=1, groups=3)
        self.c2 = nn.Conv2d(3, 4, 3, stride=3)
        self.fc = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.t1(torch.tanh(self.c1(x))))
        return self.fc(self.c2(x).flatten(1))
