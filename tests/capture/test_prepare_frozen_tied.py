"""prepare() with frozen parameters (whole layers, the bias only, the weight only; frozen
and unfrozen after prepare) and the per-parameter reasons of tied weights."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD, covered_layers, get_info, prepare

from ._helpers import TiedLM, TiedPair, check_gram, check_psg, n_records, sq_loss


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.conv = nn.Conv2d(4, 4, 3, stride=2)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(torch.tanh(self.stem(x)))).flatten(1))


def _setup(freeze: dict[str, bool]):
    torch.manual_seed(0)
    model = Stem().double()
    for name, p in model.named_parameters():
        p.requires_grad_(not freeze.get(name, False))
    orig = copy.deepcopy(model)
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64)
    return prepare(model, example_inputs=(x[:2],)), orig, x, torch.randn(5, 3, dtype=torch.float64)


def _rows(model) -> dict[str, tuple[str, str]]:
    return {p: (s, d) for p, s, d in tengrad_fx.report(model).rows}


def test_fully_frozen_layer_is_left_out_and_captures_nothing() -> None:
    prepared, orig, x, y = _setup({"stem.weight": True, "stem.bias": True})
    assert [lay.name for lay in covered_layers(prepared)] == ["conv", "fc"]
    rows = _rows(prepared)
    assert rows["stem.weight"][0] == rows["stem.bias"][0] == "frozen"
    assert "requires_grad=False" in rows["stem.weight"][1]
    rep = str(tengrad_fx.report(prepared))
    assert "4 covered, 0 fallback (SGD-momentum), 2 frozen" in rep
    ref = check_psg(prepared, orig, x, y)
    check_gram(prepared, ref)
    assert n_records(prepared) == 2  # the frozen stem ran the plain op
    assert prepared.stem.weight.grad is None
    # TENGraD trains the rest and leaves the stem untouched
    opt = TENGraD(prepared, lr=0.1, damping=0.1)
    w0 = prepared.stem.weight.detach().clone()
    for _ in range(2):
        opt.zero_grad()
        sq_loss(prepared(x), y).backward()
        opt.step()
    assert torch.equal(prepared.stem.weight, w0)
    assert opt.counters["skipped"] == 0


def test_frozen_bias_only_weight_stays_exact() -> None:
    prepared, orig, x, y = _setup({"conv.bias": True})
    layer = {lay.name: lay for lay in covered_layers(prepared)}["conv"]
    assert layer.bias is None  # J of the layer is the weight's alone
    assert _rows(prepared)["conv.bias"][0] == "frozen"
    assert _rows(prepared)["conv.weight"][0] == "covered"
    ref = check_psg(prepared, orig, x, y)  # per-sample weight grads exact, db is None
    assert layer.per_sample_grads()[1] is None
    assert layer.jacobian().shape == (5, prepared.conv.weight.numel())
    check_gram(prepared, ref)
    # one TENGraD step on the layer is the dense solve over the weight only
    opt = TENGraD(prepared, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    g = prepared.conv.weight.grad.flatten().clone()
    w0 = prepared.conv.weight.detach().clone()
    b0 = prepared.conv.bias.detach().clone()
    opt.step()
    J = ref["conv.weight"].flatten(1)
    want = torch.linalg.solve(J.T @ J / 5 + 0.05 * torch.eye(J.shape[1], dtype=J.dtype), g)
    got = (w0 - prepared.conv.weight).flatten()
    assert ((got - want).norm() / want.norm()).item() < 1e-9
    assert torch.equal(prepared.conv.bias, b0)


def test_frozen_weight_makes_a_bias_only_layer() -> None:
    prepared, orig, x, y = _setup({"conv.weight": True})
    layer = {lay.name: lay for lay in covered_layers(prepared)}["conv"]
    assert layer.bias_only and layer.params == [prepared.conv.bias]
    rows = _rows(prepared)
    assert rows["conv.weight"][0] == "frozen"
    assert rows["conv.bias"][0] == "covered" and "bias-only conv2d 'conv'" in rows["conv.bias"][1]
    ref = check_psg(prepared, orig, x, y)
    assert all(r.I is None and r.G is None for r in layer.records())  # no input kept
    J = ref["conv.bias"].flatten(1)
    torch.testing.assert_close(layer.gram(), J @ J.T, rtol=1e-10, atol=0)
    opt = TENGraD(prepared, lr=1.0, damping=0.1, momentum=0.0, curvature_every=1, kl_clip=None)
    b0 = prepared.conv.bias.detach().clone()
    g = prepared.conv.bias.grad.clone()
    opt.step()
    want = torch.linalg.solve(J.T @ J / 5 + 0.1 * torch.eye(J.shape[1], dtype=J.dtype), g)
    torch.testing.assert_close(b0 - prepared.conv.bias, want, rtol=1e-9, atol=0)


def test_unfreeze_after_prepare_works_and_old_optimizer_warns() -> None:
    prepared, orig, x, y = _setup({"stem.weight": True, "stem.bias": True})
    old_opt = TENGraD(prepared, lr=0.1, damping=0.1)
    prepared.stem.requires_grad_(True)
    orig.stem.requires_grad_(True)
    assert [lay.name for lay in covered_layers(prepared)] == ["stem", "conv", "fc"]
    assert _rows(prepared)["stem.weight"][0] == "covered"
    ref = check_psg(prepared, orig, x, y)  # captured again, exact
    check_gram(prepared, ref)
    w0 = prepared.stem.weight.detach().clone()
    with pytest.warns(RuntimeWarning, match=r"\['stem.weight', 'stem.bias'\].*build a\s+new optimizer"):
        old_opt.step()
    assert torch.equal(prepared.stem.weight, w0)  # not in the old optimizer's param group
    new_opt = TENGraD(prepared, lr=0.1, damping=0.1)
    prepared.zero_grad()
    sq_loss(prepared(x), y).backward()
    new_opt.step()
    assert not torch.equal(prepared.stem.weight, w0)
    assert "stem" in {lay.name for grp in new_opt.curvature.groups for lay in grp.layers}
    # freezing again after prepare: left out at once
    prepared.fc.requires_grad_(False)
    assert [lay.name for lay in covered_layers(prepared)] == ["stem", "conv"]
    prepared.zero_grad()
    sq_loss(prepared(x), y).backward()
    new_opt.step()
    assert new_opt.counters["skipped"] == 0


# --------------------------------------------------------------------------- tied-weight reasons
class TiedBiasPair(nn.Module):
    """Two Linears sharing only their bias."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.bias = self.a.bias
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


@pytest.mark.parametrize("cls, tied, shared_with, others", [
    (TiedPair, "a.weight", "b.weight", {"a.bias": "'a'", "b.bias": "'b'"}),
    (TiedBiasPair, "a.bias", "b.bias", {"a.weight": "'a'", "b.weight": "'b'"}),
])
def test_tied_parameter_named_and_others_get_own_reason(cls, tied, shared_with, others) -> None:
    prepared = prepare(cls(), example_inputs=(torch.randn(2, 4),))
    fb = get_info(prepared).fallback
    assert fb[tied] == f"parameter tied (shared with {shared_with})"
    which = tied.split(".")[1]
    for k, layer in others.items():
        assert fb[k].startswith(f"layer {layer} not covered: its {which} is tied"), fb[k]
        assert "parameter tied" not in fb[k]
    assert [lay.name for lay in covered_layers(prepared)] == ["out"]


def test_tied_embedding_is_covered_by_its_linear() -> None:
    prepared = prepare(TiedLM(), example_inputs=(torch.randint(0, 11, (2, 4)),))
    rows = _rows(prepared)
    assert rows["emb.weight"][0] == "covered" and "'out'" in rows["emb.weight"][1]
    assert rows["body.weight"][0] == "covered"


def test_frozen_layers_report_with_functional_loss() -> None:
    """cross-entropy training with a frozen head still reports and steps cleanly."""
    prepared, _, x, _ = _setup({"fc.weight": True, "fc.bias": True})
    y = torch.tensor([0, 1, 2, 0, 1])
    opt = TENGraD(prepared, lr=0.1, damping=0.1)
    F.cross_entropy(prepared(x), y).backward()
    opt.step()
    assert sorted(lay.name for grp in opt.curvature.groups for lay in grp.layers) == ["conv", "stem"]
