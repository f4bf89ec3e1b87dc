"""Added parameters on the module-surgery path: ``[1, ...]`` tokens read through the
module's attributes are covered exactly; a use that mixes samples is caught by prepare's
sample-independence check and falls back with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tengrad_fx import get_info, prepare
from testing.oracle import check_covered_layers

from ._helpers import Sandwich, prepared_sandwich


class Tokens(nn.Module):
    """A class token and position embeddings, with data-dependent control flow (untraceable)."""

    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 4, 4))
        self.scale = nn.Parameter(torch.ones(4))  # no leading 1: left to the fallback
        self.mix = mix

    def forward(self, x):
        n = int(x.shape[1])  # torch.fx cannot trace this
        pos = self.pos.mean(0, keepdim=True) if self.mix else self.pos
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x + pos[:, 1:n + 1]], 1)
        return x * self.scale


def test_tokens_covered_and_exact() -> None:
    prepared, orig, x, y = prepared_sandwich(Tokens())
    info = get_info(prepared)
    assert info.method == "surgery"
    assert info.covered["mid.cls_token"] == "mid.cls_token"
    assert info.covered["mid.pos"] == "mid.pos"
    assert info.covered["mid.scale"] == "mid.scale"  # replayed per sample (:mod:`tengrad_fx.capture.replay`)
    check_covered_layers(orig, prepared, x, y)


def test_mixing_use_is_replayed() -> None:
    """``pos.mean(0)`` of the batched tokens gives every sample's row the batch's gradient:
    the token capture drops it; replaying the module per sample covers it exactly."""
    prepared, orig, x, y = prepared_sandwich(Tokens(mix=True))
    info = get_info(prepared)
    assert [s.fallback_reason for s in info.layers if s.name == "mid.pos" and not s.sites] == []  # dropped spec gone
    assert "_tengrad_replay" in prepared.mid.__dict__ and "pos" in prepared.mid.__dict__["_tengrad_replay"].names
    assert info.covered["mid.pos"] == "mid.pos" and info.covered["mid.cls_token"] == "mid.cls_token"
    check_covered_layers(orig, prepared, x, y)
    out = prepared(torch.randn(4, 3, 5, dtype=x.dtype))
    F.cross_entropy(out, torch.randint(0, 3, (4,))).backward()  # trains at another batch size


@pytest.mark.parametrize("only", [True])
def test_only_linear_conv_leaves_tokens(only: bool) -> None:
    prepared = prepare(Sandwich(Tokens()), example_inputs=(torch.randn(2, 3, 5),), only_linear_conv=only)
    assert "mid.cls_token" in get_info(prepared).fallback
