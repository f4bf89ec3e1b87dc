"""Small models with one of every capture kind (mixed-precision and eager-path tests)."""
from __future__ import annotations

import timm.layers as tl
import torch
import torch.nn as nn


class AllKinds(nn.Module):
    """Conv (reflect padding: the pre-pad path), BatchNorm, transposed conv, GroupNorm,
    Conv1d, LayerNorm, RMSNorm (torch and timm), an embedding, a position token and a
    Linear head; input ``(x [m, 3, 6, 6], idx [m, 4])``, output ``[m, 5]``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(4)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.gn = nn.GroupNorm(2, 4)
        self.seq = nn.Conv1d(4, 6, 3, padding=1)
        self.ln = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.trms = tl.RmsNorm(6)
        self.emb = nn.Embedding(11, 6, padding_idx=0)
        self.pos = nn.Parameter(torch.randn(1, 6) * 0.1)
        self.fc = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.conv(x)))
        h = torch.tanh(self.gn(self.up(h)))  # [m, 4, 12, 12]
        h = self.seq(h.flatten(2)[:, :, :16])  # [m, 6, 16]
        t = h.transpose(1, 2)[:, :4] + self.emb(idx) + self.pos  # [m, 4, 6]
        t = self.trms(self.rms(self.ln(t)))
        return self.fc(torch.tanh(t).mean(1))


def inputs(m: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 3, 6, 6, generator=g), torch.randint(0, 11, (m, 4), generator=g)
