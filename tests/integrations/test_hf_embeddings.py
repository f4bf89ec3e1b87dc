"""Tied input/output embeddings and position embeddings of real Hugging Face models:
covered, and exact against ``torch.func`` in float64."""
from __future__ import annotations

import torch

from tengrad_fx import get_info, report

from ._hf import V, Call, build, check_exact


def _ids(m: int = 4, T: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, V, (m, T), generator=g), torch.randint(0, V, (m, T), generator=g)


def test_gpt2_tied_lm_head_and_positions_exact() -> None:
    x, y = _ids()
    model = check_exact(Call(build("gpt2")), x, y)
    info = get_info(model)
    assert info.covered["model.transformer.wte.weight"] == "model.lm_head"
    assert info.covered["model.transformer.wpe.weight"] == "model.transformer.wpe"


def test_bert_position_embeddings_exact() -> None:
    x, _ = _ids()
    y = torch.randint(0, 3, (4,))
    model = check_exact(Call(build("bert")), x, y)
    assert report(model).fraction_params == 1.0


def test_t5_shared_embedding_tied_three_ways_exact() -> None:
    """``shared``, the encoder's and the decoder's ``embed_tokens`` and ``lm_head``: one block."""
    x, y = _ids()
    dec = torch.randint(1, V, (1, 4), generator=torch.Generator().manual_seed(3))
    model = check_exact(Call(build("t5"), decoder_input_ids=dec), x, y[:, :4])
    assert get_info(model).covered["model.shared.weight"] == "model.lm_head"
