"""Folded batches (a layer input of ``P·m`` rows): the perturbation probe finds the rows of
each sample, the layer is exact with those rows as its positions (float64, against
``torch.func`` ``vmap(grad)`` on the ORIGINAL model, and the TENGraD step against the dense
block solve); rows that mix samples fall back with that reason."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.capture.folded_rows import FOLDS
from testing import check_covered_layers, check_tengrad_step, per_sample_grads_reference

TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Folded(nn.Module):
    """``x [m, P, N, 3]`` folded to ``[m·P, N, ·]`` (``order="sample"``: rows ``b·P + p``, as
    mobilevit and swin windows) or ``[P·m, N, ·]`` (``order="patch"``: rows ``p·m + b``);
    Linear, LayerNorm and attention over ``N`` inside each folded row, then unfolded."""

    def __init__(self, order: str, mix: bool = False, dropout: float = 0.0, f_dropout: float = 0.0):
        super().__init__()
        self.order, self.mix, self.f_dropout = order, mix, f_dropout
        self.stem = nn.Linear(3, 4)
        self.qk = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(4)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, P, N, _ = x.shape
        h = torch.tanh(self.stem(x))
        h = h.reshape(m * P, N, 4) if self.order == "sample" else h.transpose(0, 1).reshape(P * m, N, 4)
        if self.mix:  # every row sees the whole batch: not a per-sample layout
            h = h + h.mean(0, keepdim=True)
        if self.f_dropout:  # functional: traced as F.dropout(training=True) in the train graph
            h = F.dropout(h, self.f_dropout, self.training)
        q, k = self.qk(h).chunk(2, -1)
        h = self.norm(h + self.drop(torch.softmax(q @ k.transpose(1, 2), -1) @ h))
        h = self.out(h)
        h = h.reshape(m, P, N, 4) if self.order == "sample" else h.reshape(P, m, N, 4).transpose(0, 1)
        return self.head(h.mean((1, 2)))


def _setup(order: str, seed: int = 0, m: int = 4):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    net = Folded(order).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    orig = copy.deepcopy(net)
    x = torch.randn(m, 3, 5, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (m,))
    return net, orig, x, y


@pytest.mark.parametrize("order", ["sample", "patch"])
def test_folded_rows_are_exact(order: str) -> None:
    net, orig, x, y = _setup(order)
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback, info.fallback
    key = info.store.key
    folds = {spec.name: FOLDS.get((key, spec.sites[0])) for spec in info.layers}
    want = (1, 15) if order == "sample" else (3, 5)  # [A, m, C] rows: A·C = P·N = 15
    assert folds == {"stem": None, "head": None, "qk": want, "norm": want, "out": want}
    assert rel(prepared(x), orig(x)) <= 1e-14
    check_covered_layers(orig, prepared, x, y)


@pytest.mark.parametrize("order", ["sample", "patch"])
def test_tengrad_step_on_folded_rows_is_exact(order: str) -> None:
    net, orig, x, y = _setup(order, seed=1, m=5)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(model, opt, orig, x, y, 0.05)


def test_rows_that_mix_samples_fall_back_with_reason() -> None:
    torch.manual_seed(0)
    net = Folded("sample", mix=True)
    prepared = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 3, 5, 3),))
    fb = tengrad_fx.get_info(prepared).fallback
    for n in ("qk.weight", "norm.weight", "out.bias"):
        assert "does not index samples" in fb[n] and "not a fixed index set" in fb[n], fb[n]
    assert "stem.weight" not in fb and "head.weight" not in fb


@pytest.mark.parametrize("kw", [dict(dropout=0.5), dict(f_dropout=0.5)])
def test_fold_probe_ignores_dropout_and_runs_at_another_batch(kw: dict) -> None:
    torch.manual_seed(0)
    net = Folded("patch", **kw)
    prepared = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 3, 5, 3),))
    assert not tengrad_fx.get_info(prepared).fallback
    x = torch.randn(6, 3, 5, 3)
    F.cross_entropy(prepared(x), torch.randint(0, 3, (6,))).backward()
    for layer in tengrad_fx.covered_layers(prepared):
        assert layer.m == 6, layer.name
    with pytest.raises(RuntimeError, match="folded batch"):
        prepared(torch.randn(6, 3, 4, 3))  # N changed: the probed row layout no longer fits


def test_mobilevit_fully_covered_and_exact() -> None:
    """timm mobilevit_xxs: its transformer sees (B·P, N, D) rows. Eval mode (BN running
    statistics), float64, against vmap(grad)."""
    torch.manual_seed(0)
    model = timm.create_model("mobilevit_xxs", pretrained=False, num_classes=5).double().eval()
    orig = copy.deepcopy(model)
    x, y = torch.randn(3, 3, 64, 64, dtype=torch.float64), torch.tensor([0, 4, 2])
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    rep = tengrad_fx.report(prepared)
    assert rep.fraction_params == 1.0, rep.fallbacks
    prepared.eval()
    F.cross_entropy(prepared(x), y).backward()
    ref = per_sample_grads_reference(orig, x, F.cross_entropy, y)
    names = {id(p): n for n, p in prepared.named_parameters()}
    key = tengrad_fx.get_info(prepared).store.key
    n_folded = 0
    for layer in tengrad_fx.covered_layers(prepared):
        n_folded += any((key, s) in FOLDS for s in layer.spec.sites)
        dW, db = layer.per_sample_grads()
        assert rel(dW, ref[names[id(layer.weight)]]) <= 1e-8, layer.name
        if db is not None:
            assert rel(db, ref[names[id(layer.bias)]]) <= 1e-8, layer.name
    assert n_folded >= 30  # every transformer Linear and LayerNorm
