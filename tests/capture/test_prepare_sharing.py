"""prepare(): weight sharing and tying, functional reuse, keyword calls, subclasses."""
from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD, covered_layers, get_info, prepare
from testing.oracle import check_covered_layers, dense_layer_updates

from ._helpers import KwargCall, TiedLM, TiedPair, WithSubclasses, check_psg


# --------------------------------------------------------------------------- weight sharing / tying
class Shared(nn.Module):
    """One Linear applied on two branches (and reachable under a second name)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)
        self.alias = self.fc  # the same module registered twice: sharing, not tying

    def forward(self, x):
        a = self.fc(x)
        b = self.alias(torch.tanh(x) * 2)
        return self.out(torch.tanh(a) + b)


def test_module_called_twice_is_exact_with_two_sites() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 5, dtype=torch.float64)
    model = Shared().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    layers = {layer.name: layer for layer in covered_layers(prepared)}
    assert set(layers) == {"fc", "out"}
    assert len(layers["fc"].spec.sites) == 2 and len(layers["out"].spec.sites) == 1
    assert "calls=2" in str(tengrad_fx.report(prepared))
    y = torch.randn(4, 2, dtype=torch.float64)
    check_psg(prepared, orig, x, y)
    assert len(layers["fc"].records()) == 2



def test_subclass_overriding_forward_is_fallback() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 3, 5, 5, dtype=torch.float64)
    model = WithSubclasses().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert re.search(r"WSConv2d overrides Conv2d\.forward", info.fallback["ws.weight"])
    assert "ws.bias" in info.fallback
    assert {layer.name for layer in covered_layers(prepared)} == {"conv", "fc"}
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    check_psg(prepared, orig, x, torch.randn(3, 3, dtype=torch.float64))



@pytest.mark.parametrize("padding_idx", [None, 0])
@pytest.mark.parametrize("strategy", ["factor", "materialize"])
def test_weight_tied_to_embedding_is_one_block(padding_idx, strategy) -> None:
    """Tied input/output embeddings: one block holding the lookup's and the Linear's calls,
    exact (per-sample gradients, Gram, Jv, Jᵀc; and a TENGraD step whose backward
    materializes the lookup's per-sample gradients by scatter, or keeps its records)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 11, (5, 4))
    tokens[0, 0] = 0
    model = TiedLM().double()
    model.emb.padding_idx = padding_idx
    orig = copy.deepcopy(model)
    keys = list(model.state_dict().keys())
    prepared = prepare(model, example_inputs=(tokens[:2],))
    info = get_info(prepared)
    assert list(prepared.state_dict().keys()) == keys  # both emb.weight and out.weight
    assert info.covered["emb.weight"] == "out"
    assert [layer.name for layer in covered_layers(prepared)] == ["body", "out"]
    assert prepared.out.weight is prepared.emb.weight
    y = torch.randint(0, 11, (5, 4))
    loss = lambda out, t: F.cross_entropy(out.reshape(-1, 11), t.reshape(-1))
    check_covered_layers(orig, prepared, tokens, y, loss_fn=loss)
    prepared.zero_grad()
    opt = TENGraD(prepared, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None, strategy=strategy)
    for _ in range(2):  # the second backward materializes where the cost model chose it
        prepared.zero_grad()
        loss(prepared(tokens), y).backward()
        grads = {n: p.grad.detach().clone() for n, p in prepared.named_parameters()}
        before = {n: p.detach().clone() for n, p in prepared.named_parameters()}
        opt.step()
        orig.load_state_dict({n: t for n, t in before.items()}, strict=False)
        ref = dense_layer_updates(orig, tokens, y, loss, grads, 0.05, info.covered)
        for n, p in prepared.named_parameters():
            assert torch.allclose(before[n] - p.detach(), ref[n], rtol=1e-8, atol=1e-12), n


def test_tied_embedding_with_biased_linear_exact() -> None:
    """A Linear with a bias tied to an Embedding: one block, the lookup adding nothing to
    the bias gradient (BERT's decoder)."""
    torch.manual_seed(0)
    model = TiedLM().double()
    model.out.bias = nn.Parameter(torch.randn(11, dtype=torch.float64))
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(torch.randint(0, 11, (2, 4)),))
    assert get_info(prepared).covered["emb.weight"] == get_info(prepared).covered["out.bias"] == "out"
    tokens, y = torch.randint(0, 11, (5, 4)), torch.randint(0, 11, (5, 4))
    check_covered_layers(orig, prepared, tokens, y, loss_fn=lambda out, t: F.cross_entropy(out.reshape(-1, 11),
                                                                                           t.reshape(-1)))


class FunctionalReuse(nn.Module):
    """A covered weight also used functionally (F.linear) elsewhere in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        # reading only metadata (.shape) is not a use
        h = self.fc(x) + F.linear(x, self.fc.weight).reshape(-1, self.fc.weight.shape[0])
        return self.out(torch.tanh(h))



class MetaOnly(nn.Module):
    """Reads a covered weight's dtype/shape only: still covered."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        x = x.to(self.fc.weight.dtype).reshape(x.shape[0], self.fc.weight.shape[1])
        return self.out(torch.tanh(self.fc(x)))


@pytest.mark.parametrize("cls, dropped, why", [
    (TiedPair, {"a", "b"}, "tied"),
    (FunctionalReuse, {"fc"}, "read outside the layer call"),
    (KwargCall, {"fc"}, "keyword"),
    (MetaOnly, set(), ""),
])
def test_shared_weights_are_exact_or_fallback(cls, dropped, why) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    model = cls().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    names = {layer.name for layer in covered_layers(prepared)}
    linears = {n for n, mod in orig.named_modules() if isinstance(mod, nn.Linear)}
    assert names == linears - dropped, names
    for k, _ in orig.named_parameters():
        if k.split(".")[0] in dropped:
            assert why in info.fallback[k], (k, info.fallback.get(k))
        else:
            assert k in info.covered, k
    # covered_layers never hands out a parameter reported as fallback
    for layer in covered_layers(prepared):
        for p in (layer.weight, layer.bias):
            assert all(q is not p for k, q in prepared.named_parameters() if k in info.fallback)
    check_psg(prepared, orig, x, torch.randn(3, 2, dtype=torch.float64))


