"""Every :class:`LayerSpec` that ``prepare`` builds carries only its declared dataclass
fields: the ones of covered layers, of layers dropped to the fallback (tied weights, an
added parameter that mixes samples), of tied lookups merged into their Linear, and of
modules swapped by surgery (whole model, or inside an fx leaf)."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn as nn

from tengrad_fx import get_info, prepare
from tengrad_fx.capture.info import PrepareInfo
from tengrad_fx.capture.match import LayerSpec

from ._helpers import CNN, Sandwich, TiedPair, cnn_batch


def undeclared(spec: LayerSpec) -> set[str]:
    """Instance attributes of ``spec`` that are not dataclass fields."""
    return set(vars(spec)) - {f.name for f in dataclasses.fields(spec)}


class TiedTransformer(nn.Module):
    """Token and position embeddings, one encoder layer, a norm and an output Linear tied to
    the token embedding; a second pair of Linears shares a weight (dropped to the fallback)."""

    def __init__(self, vocab: int = 13, d: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 4, d) * 0.1)
        self.block = nn.TransformerEncoderLayer(d, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.b.weight = self.a.weight
        self.norm = nn.LayerNorm(d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.block(self.tok(tokens) + self.pos)
        h = self.b(torch.tanh(self.a(h)))
        return self.out(self.norm(h))


class Tokens(nn.Module):
    """A class token, and position embeddings averaged over the batch (they mix samples, so
    prepare drops them), with data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 4, 4))
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[1])
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x + self.pos.mean(0, keepdim=True)[:, 1:n + 1]], 1)
        return self.fc(x)


@pytest.fixture
def built_specs(monkeypatch: pytest.MonkeyPatch) -> list[LayerSpec]:
    """Every spec ``prepare`` had before it kept the covered ones (``_classify_params``)."""
    seen: list[LayerSpec] = []
    prepare_module = importlib.import_module("tengrad_fx.capture.prepare")  # the package exports the function
    classify = prepare_module._classify_params

    def spy(model: nn.Module, info: PrepareInfo) -> None:
        seen.extend(info.layers)
        classify(model, info)

    monkeypatch.setattr(prepare_module, "_classify_params", spy)
    return seen


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    x, _ = cnn_batch()
    return CNN(), (x[:2],)


def _tied_transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TiedTransformer(), (torch.randint(0, 13, (2, 4)),)


def _surgery() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Sandwich(Tokens()), (torch.randn(2, 3, 5),)


def _tied_pair() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TiedPair(), (torch.randn(2, 4),)


@pytest.mark.parametrize("build, method", [(_cnn, "fx"), (_tied_transformer, "fx-dual"), (_surgery, "surgery"),
                                           (_tied_pair, "fx")], ids=["cnn", "tied_transformer", "surgery", "tied"])
def test_specs_carry_only_declared_fields(build, method: str, built_specs: list[LayerSpec]) -> None:
    torch.manual_seed(0)
    model, example = build()
    prepared = prepare(model, example_inputs=example)
    info = get_info(prepared)
    assert info.method == method
    assert built_specs, "prepare built no layer"
    dropped = [spec for spec in built_specs if not spec.sites]
    for spec in built_specs:
        assert not undeclared(spec), (spec.name, undeclared(spec))
        assert not spec.tied_lookups, spec.name  # merged (or dropped) by merge_tied_lookups
        copy = dataclasses.replace(spec)
        assert copy == spec and vars(copy) == vars(spec), spec.name
    for spec in dropped:  # the fallback's reasons live in declared fields
        assert spec.fallback_reason and spec.dropped_sites, spec.name
    if build is _tied_transformer:
        out = next(spec for spec in info.layers if spec.name == "out")
        assert out.tied_names == ["tok"] and "tok" not in {spec.name for spec in info.layers}
        assert {"a", "b"} <= {spec.name for spec in dropped}
        assert info.fallback["a.weight"].startswith("parameter tied")
    if build is _surgery:
        assert {spec.name for spec in built_specs if spec.surgery} == {"mid.cls_token", "mid.pos"}
        assert [spec.name for spec in dropped] == ["mid.pos"]  # the token capture mixes samples:
        assert info.covered["mid.pos"] == "mid.pos" and not info.fallback  # replayed per sample instead


def test_undeclared_attribute_is_detected() -> None:
    spec = LayerSpec(name="fc", kind="linear", module=nn.Linear(2, 2))
    assert not undeclared(spec)
    spec.__dict__["extra"] = 1
    assert undeclared(spec) == {"extra"}


def test_mutable_fields_are_not_shared() -> None:
    a, b = (LayerSpec(name=n, kind="linear", module=nn.Linear(2, 2)) for n in "ab")
    a.sites.append(0)
    a.dropped_sites.append(1)
    a.param_reasons[0] = "why"
    a.tied_lookups.append(b)
    a.tied_names.append("b")
    assert (b.sites, b.dropped_sites, b.param_reasons, b.tied_lookups, b.tied_names) == ([], [], {}, [], [])
