"""Real Hugging Face models (``transformers``, small random configs, float64): at least
99 % of the parameters preconditioned, and every covered layer exact against
``torch.func`` (per-sample gradients, Gram, ``Jv``, ``Jᵀc``) with one TENGraD step equal
to dense block NGD — tied input/output embeddings, position embeddings whose ids all
samples share, class tokens, Conv1D and RMSNorm included.

Llama's and T5's norms compute in float32 inside a float64 model; ``vmap`` backpropagates
those float32 ops in another order, so the reference is float32-accurate there (1e-6).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tengrad_fx import get_info, prepare, report

from ._hf import V, Call, build, check_exact


def _inputs(name: str, m: int = 4, seed: int = 0) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(extra call kwargs, x, y)`` for the family ``name``."""
    g = torch.Generator().manual_seed(seed)
    if name == "vit":
        return dict(name="pixel_values"), torch.randn(m, 3, 8, 8, generator=g, dtype=torch.float64), \
            torch.randint(0, 3, (m,), generator=g)
    x = torch.randint(1, V, (m, 5), generator=g)
    if name == "bert":
        return {}, x, torch.randint(0, 3, (m,), generator=g)
    if name == "t5":
        dec = torch.randint(1, V, (1, 4), generator=g)
        return dict(decoder_input_ids=dec), x, torch.randint(0, V, (m, 4), generator=g)
    return {}, x, torch.randint(0, V, (m, 5), generator=g)


FAMILIES = ["bert", "gpt2", "llama", "t5", "vit"]


@pytest.mark.parametrize("name", FAMILIES)
def test_coverage_at_least_99_percent(name: str) -> None:
    """Two blocks of width 32 (prepare only), called with a dict of keyword inputs."""
    extra, x, _ = _inputs(name)
    key = extra.pop("name", "input_ids")
    model = build(name, layers=2, width=32)
    extra = {k: v.expand(2, *v.shape[1:]) for k, v in extra.items()}  # decoder ids: per sample
    prepared = prepare(model, example_inputs={key: x[:2], **extra})
    rep = report(prepared)
    assert rep.fraction_params >= 0.99, str(rep)
    if name != "t5":  # T5's relative attention bias [32 buckets, heads] is indexed by position pairs
        assert rep.fraction_params == 1.0, str(rep)


@pytest.mark.parametrize("name", FAMILIES)
def test_exact_against_torch_func(name: str) -> None:
    extra, x, y = _inputs(name)
    model = check_exact(Call(build(name), **extra), x, y, tol=1e-6 if name in ("llama", "t5") else 1e-10)
    covered = get_info(model).covered
    if name == "gpt2":  # tied with lm_head: one block; positions shared by all samples
        assert covered["model.transformer.wte.weight"] == "model.lm_head"
        assert covered["model.transformer.wpe.weight"] == "model.transformer.wpe"
    if name == "t5":  # shared, the encoder's and decoder's embed_tokens and lm_head: one block
        assert covered["model.shared.weight"] == "model.lm_head"
    if name == "vit":  # added parameters inside an untraceable module
        assert covered["model.vit.embeddings.cls_token"] == "model.vit.embeddings.cls_token"
