"""A small MLP-Mixer (Tolstikhin et al., 2021) for 1×28×28 images.

Patches ``p×p`` (``p = 4``: 49 tokens) embedded to width ``D`` by a Linear, then ``depth``
blocks of

    x ← x + TokenMLP(LN(x)ᵀ)ᵀ      (Linear T→h_t, GELU, Linear h_t→T: across tokens)
    x ← x + ChannelMLP(LN(x))      (Linear D→h_c, GELU, Linear h_c→D: across channels)

then LayerNorm, the mean over tokens and a Linear head. Shapes: ``[N, C, H, W]`` →
``[N, T, C·p²]`` → ``[N, T, D]`` → ``[N, classes]``. Every parametrized layer is a Linear or a
LayerNorm.
"""
from __future__ import annotations

from torch import Tensor, nn

__all__ = ["MLPMixer"]


class _MLP(nn.Sequential):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, width: int, token_hidden: int, channel_hidden: int) -> None:
        super().__init__()
        self.norm1, self.token_mlp = nn.LayerNorm(width), _MLP(tokens, token_hidden)
        self.norm2, self.channel_mlp = nn.LayerNorm(width), _MLP(width, channel_hidden)

    def forward(self, x: Tensor) -> Tensor:  # [N, T, D]
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer on ``in_chans × image × image`` inputs (module docstring)."""

    def __init__(self, num_classes: int = 10, in_chans: int = 1, image: int = 28, patch: int = 4,
                 width: int = 128, depth: int = 4, token_hidden: int = 64, channel_hidden: int = 256) -> None:
        super().__init__()
        if image % patch:
            raise ValueError(f"MLPMixer: image size {image} is not a multiple of patch {patch}")
        self.patch = patch
        tokens = (image // patch) ** 2
        self.embed = nn.Linear(in_chans * patch * patch, width)
        self.blocks = nn.Sequential(*(_MixerBlock(tokens, width, token_hidden, channel_hidden) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # [N, C, H, W] -> [N, classes]
        p = self.patch
        n, c, h, w = x.shape
        patches = x.reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(n, -1, c * p * p)
        return self.head(self.norm(self.blocks(self.embed(patches))).mean(dim=1))
