"""prepare(): the sample-dimension checks (folded batches, constant grids, sequences)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tengrad_fx import capturing, covered_layers, get_info, prepare

from ._helpers import check_psg, sq_loss


# --------------------------------------------------------------------------- sample dimension
class Folded(nn.Module):
    """(B, T, D) -> (B*T, D) before a Linear: its rows are not samples."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x.reshape(-1, x.shape[-1]))
        h = h.reshape(x.shape[0], x.shape[1], -1)
        return self.out(torch.tanh(h).mean(1))


class FoldedMixed(Folded):
    """(B, T, D) -> (B*T, D), centred over all rows: every row depends on every sample."""

    def forward(self, x):
        r = x.reshape(-1, x.shape[-1])
        h = self.fc(r - r.mean(0))
        h = h.reshape(x.shape[0], x.shape[1], -1)
        return self.out(torch.tanh(h).mean(1))


class Grid(nn.Module):
    """A conv applied to a constant (1, C, H, W) grid, broadcast-added to the features."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("grid", torch.randn(1, 2, 6, 6))
        self.pos = nn.Conv2d(2, 4, 3, padding=1)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        h = self.conv(x) + self.pos(self.grid)
        return self.fc(torch.tanh(h).flatten(1))


class Seq(nn.Module):
    """Linear on (B, T, D) and on (B, T1, T2, D)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.fc2 = nn.Linear(6, 3)
        self.fc3 = nn.Linear(3, 2, bias=False)

    def forward(self, x):  # x: (B, T, 4)
        h = self.fc2(F.gelu(self.fc1(x)))  # (B, T, 3)
        h = h.unsqueeze(2) * h.unsqueeze(1)  # (B, T, T, 3)
        return self.fc3(torch.tanh(h))  # (B, T, T, 2)


def test_batch_folded_linear_is_fallback_with_example_inputs() -> None:
    """Rows that mix samples fall back (rows that are a fixed per-sample index set are
    covered: tests/capture/test_folds.py)."""
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    model = FoldedMixed().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert "fc.weight" in info.fallback and "fc.bias" in info.fallback
    assert "does not index samples" in info.fallback["fc.weight"]
    assert "not a fixed index set" in info.fallback["fc.weight"]
    assert [layer.name for layer in covered_layers(prepared)] == ["out"]
    assert info.covered == {"out.weight": "out", "out.bias": "out"}
    y = torch.randn(3, 3, dtype=torch.float64)
    sq_loss(prepared(x), y).backward()
    (out,) = covered_layers(prepared)  # 'out': sample i's terms of the batch gradient
    dW, db = out.per_sample_grads()
    torch.testing.assert_close(dW.mean(0), prepared.out.weight.grad)
    torch.testing.assert_close(db.mean(0), prepared.out.bias.grad)
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    # the fallback's gradient is still the full one
    orig.zero_grad()
    sq_loss(orig(x), y).backward()
    torch.testing.assert_close(prepared.fc.weight.grad, orig.fc.weight.grad)


def test_batch_folded_linear_without_example_inputs_raises_at_run_time() -> None:
    x = torch.randn(3, 5, 4)
    prepared = prepare(Folded())
    assert not get_info(prepared).verified
    with torch.no_grad():  # nothing captured, nothing checked
        prepared(x)
    with pytest.raises(RuntimeError, match=r"layer 'fc'.*does not index\s+samples"):
        prepared(x)
    with capturing(prepared, False):
        prepared(x).sum().backward()


def test_constant_grid_conv_is_fallback() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 3, 6, 6, dtype=torch.float64)
    model = Grid().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert "does not index samples" in info.fallback["pos.weight"]
    assert "does not index samples" in info.fallback["pos.bias"]
    assert {layer.name for layer in covered_layers(prepared)} == {"conv", "fc"}
    check_psg(prepared, orig, x, torch.randn(3, 3, dtype=torch.float64))
    # without example_inputs the run-time check names the layer
    p2 = prepare(copy.deepcopy(orig))
    with pytest.raises(RuntimeError, match="'pos'"):
        p2(x)


def test_linear_on_sequences_is_covered_and_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    model = Seq().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert set(info.covered) == {k for k, _ in orig.named_parameters()}
    assert info.fallback == {}
    y = torch.randn(3, 4, 4, 2, dtype=torch.float64)
    check_psg(prepared, orig, x, y)
    store = get_info(prepared).store
    (site,) = {layer.name: layer for layer in covered_layers(prepared)}["fc3"].spec.sites
    (rec,) = store.records[site]
    assert rec.I is None or tuple(rec.I.shape) == (3, 4, 4, 3)  # Linear input kept as (B, T, T, D)


def test_sequences_without_example_inputs_run_and_are_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 4, dtype=torch.float64)
    model = Seq().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model)
    check_psg(prepared, orig, x, torch.randn(3, 4, 4, 2, dtype=torch.float64))

