"""Small models for the compile matrix: every activation and in-place op around covered
layers, and every capture kind, each with an input maker and a class count."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


class Activations(nn.Module):
    """Linear layers, each input coming right after an activation or in-place op and each
    output going right into one: ReLU, ReLU(inplace), LeakyReLU, GELU, SiLU, Hardswish,
    Sigmoid, ReLU6, an in-place residual ``+=``, ``x.relu_()``, dropout, and a Linear on a
    folded batch (each sample's features as two rows). ``[m, 6] -> [m, 3]``."""

    def __init__(self, d: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(6, d)
        self.lin = nn.ModuleList(nn.Linear(d, d) for _ in range(10))
        self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU(inplace=True), nn.LeakyReLU(0.1), nn.GELU(), nn.SiLU(),
                                   nn.Hardswish(), nn.Sigmoid(), nn.ReLU6()])
        self.drop = nn.Dropout(0.25)
        self.fold = nn.Linear(d // 2, d // 2)
        self.head = nn.Linear(d, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.inp(x))
        for lin, act in zip(self.lin, self.acts):
            h = act(lin(h))
        r = self.lin[8](h)
        r += h  # in-place residual add on a covered layer's output
        h = self.lin[9](r.relu_())
        h = F.gelu(self.fold(h.reshape(-1, h.shape[1] // 2))).reshape(h.shape)  # rows [2m, d/2]
        return self.head(self.drop(h).relu_())


class Convs(nn.Module):
    """Conv2d, BatchNorm, depthwise and grouped conv, GroupNorm, ConvTranspose2d, Conv1d,
    Conv3d, ConvTranspose1d and a Linear head with ReLU-family activations between them.
    ``[m, 2, 6, 6] -> [m, 4]``."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)
        self.gc = nn.Conv2d(4, 6, 3, padding=1, groups=2)
        self.gn = nn.GroupNorm(2, 6)
        self.up = nn.ConvTranspose2d(6, 3, 2, stride=2)
        self.c3 = nn.Conv3d(1, 2, 3, padding=1)
        self.c1d = nn.Conv1d(6, 4, 3, padding=1)
        self.t1d = nn.ConvTranspose1d(4, 4, 3)
        self.head = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn(self.c1(x)))
        h = F.relu6(self.dw(h)) + h
        h = F.hardswish(self.gn(self.gc(h)))
        h = self.up(h).relu_()  # [m, 3, 12, 12]
        v = F.leaky_relu(self.c3(h[:, :1].reshape(-1, 1, 3, 6, 8)))  # [m, 2, 3, 6, 8]
        s = F.relu(self.c1d(v.reshape(v.shape[0], 6, -1)))  # [m, 4, 48]
        s = F.relu(self.t1d(s))
        return self.head(s.mean(2))


class Tokens(nn.Module):
    """Embedding, LayerNorm, multi-head attention (its projections), RMSNorm, a Linear on
    the flattened tokens (``[m·L, d]``: integer inputs cannot be perturbed, so ``prepare``
    leaves it to the fallback, the folded batch is covered in :class:`Activations`) and
    Linear layers with ReLU/GELU. ``[m, L] int -> [m, 5]``."""

    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.rms = nn.RMSNorm(d)
        self.fold = nn.Linear(d, d)
        self.ff = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, 5)

    def forward(self, idx: Tensor) -> Tensor:
        t = self.ln(self.emb(idx))
        a, _ = self.attn(t, t, t, need_weights=False)
        t = self.rms(F.relu(a) + t)
        m, L, d = t.shape
        t = F.relu(self.fold(t.reshape(m * L, d))).reshape(m, L, d)
        t = t + self.out(F.gelu(self.ff(t)))
        return self.head(t.relu().mean(1))


def make(name: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return {"activations": Activations, "convs": Convs, "tokens": Tokens}[name]().to(dtype)


def batch(name: str, m: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """``(x, y)``: inputs and class labels for ``make(name)``."""
    g = torch.Generator().manual_seed(seed)
    if name == "tokens":
        return torch.randint(0, 13, (m, 5), generator=g), torch.randint(0, 5, (m,), generator=g)
    shape, classes = {"activations": ((m, 6), 3), "convs": ((m, 2, 6, 6), 4)}[name]
    return torch.randn(*shape, generator=g, dtype=dtype), torch.randint(0, classes, (m,), generator=g)
