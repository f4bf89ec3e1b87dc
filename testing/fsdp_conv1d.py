"""The transposed-Linear models of the FSDP2 tests (Hugging Face's ``Conv1D``: weight
``[d_in, d_out]``, which ``fully_shard`` shards on ``d_in``): "conv1d", two ``Conv1D``
layers of odd widths (uneven shards of the weights and of the biases) over a sequence;
"gpt2", a one-layer ``GPT2LMHeadModel`` (its embedding tied to the head, no dropout),
called on token ids for its logits. :func:`testing.fsdp_workers.make_model` builds them.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn as nn

__all__ = ["TRANSPOSED_KINDS", "build", "batch", "blocks"]

TRANSPOSED_KINDS = ("conv1d", "gpt2")
SEQ, D_IN, CLASSES, VOCAB = 4, 6, 5, 50


class Conv1DNet(nn.Module):
    """``[m, SEQ, 6]`` → ``Conv1D(6 → 7)``, tanh, ``Conv1D(7 → 5)``: logits ``[m, SEQ, 5]``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D
        self.c1, self.c2 = Conv1D(7, D_IN), Conv1D(CLASSES, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.tanh(self.c1(x)))


class Logits(nn.Module):
    """``model(input_ids=x).logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x).logits


def build(kind: str) -> nn.Module:
    """The model ``kind`` (seeded by the caller), float64."""
    if kind == "conv1d":
        return Conv1DNet()
    import transformers
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Logits(transformers.GPT2LMHeadModel(cfg))


def batch(kind: str, M: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and per-position targets of ``M`` samples."""
    if kind == "conv1d":
        x = torch.randn(M, SEQ, D_IN, generator=g, dtype=torch.float64)
        return x, torch.randint(0, CLASSES, (M, SEQ), generator=g)
    return torch.randint(0, VOCAB, (M, SEQ), generator=g), torch.randint(0, VOCAB, (M, SEQ), generator=g)


def blocks(net: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: GPT-2's blocks (none in "conv1d")."""
    return [mod for mod in net.modules() if type(mod).__name__ == "GPT2Block"]
