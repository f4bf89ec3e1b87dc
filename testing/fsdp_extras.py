"""A model of the FSDP2 tests with layers recorded as per-sample gradients only: "mlp-extras",
an added parameter ``pos [1, 6]`` (a learned offset of the input, covered by ``prepare``'s
surgery: :mod:`tengrad_fx.capture.added_params`; ``fully_shard`` gives its one row to one
rank) and a bias-only layer (``fc2``'s weight frozen), around the polar tests' MLP; built by
:func:`testing.fsdp_workers.make_model`, batches of :func:`testing.fsdp_polar.batch`.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .fsdp_polar import MLP

__all__ = ["ExtrasMLP"]


class ExtrasMLP(MLP):
    """:class:`~testing.fsdp_polar.MLP` on ``x + pos``, ``fc2.weight`` frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(0.1 * torch.randn(1, 6))
        self.fc2.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.pos)
