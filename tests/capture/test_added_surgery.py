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
    assert "added parameter of shape (4,)" in info.fallback["mid.scale"]
    check_covered_layers(orig, prepared, x, y)


def test_mixing_use_falls_back() -> None:
    """``pos.mean(0)`` of the batched tokens gives every sample's row the batch's gradient."""
    x = torch.randn(2, 3, 5)
    prepared = prepare(Sandwich(Tokens(mix=True)), example_inputs=(x,))
    info = get_info(prepared)
    assert "mixes samples" in info.fallback["mid.pos"]
    assert info.covered["mid.cls_token"] == "mid.cls_token"
    out = prepared(torch.randn(4, 3, 5))
    F.cross_entropy(out, torch.randint(0, 3, (4,))).backward()  # still trains


@pytest.mark.parametrize("only", [True])
def test_only_linear_conv_leaves_tokens(only: bool) -> None:
    prepared = prepare(Sandwich(Tokens()), example_inputs=(torch.randn(2, 3, 5),), only_linear_conv=only)
    assert "mid.cls_token" in get_info(prepared).fallback
