"""Module surgery: a layer whose weight the model uses without calling the layer (as
state-space mixers pass a conv's weight to a fused kernel) falls back with its reason,
and the optimizer steps; a layer on a branch the example inputs do not take stays covered."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx


class WeightUsedDirectly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if float(x.abs().sum()) >= 0:  # data-dependent: torch.fx cannot trace it (module surgery)
            x = F.linear(x, self.inner.weight, self.inner.bias)  # the module itself is never called
        return self.head(torch.tanh(x))


def test_uncalled_layer_falls_back_and_the_step_runs() -> None:
    torch.manual_seed(0)
    model = WeightUsedDirectly().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 2, (6,))
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert info.method == "surgery"
    assert [spec.name for spec in info.layers] == ["head"]
    reasons = {p: d for p, s, d in tengrad_fx.report(prepared).rows if s != "covered"}
    assert "without calling the module" in reasons["inner.weight"]
    opt = tengrad_fx.TENGraD(prepared, lr=0.1, damping=0.1, curvature_every=1, kl_clip=None, momentum=0.0)
    before = [p.detach().clone() for p in prepared.parameters()]
    F.cross_entropy(prepared(x), y).backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, prepared.parameters()))


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) if float(x.sum()) >= 0 else self.b(x)  # data-dependent: module surgery


def test_layer_on_a_branch_not_taken_stays_covered() -> None:
    x = torch.ones(2, 4)  # takes branch a
    prepared = tengrad_fx.prepare(Branches(), example_inputs=(x,))
    info = tengrad_fx.get_info(prepared)
    assert info.method == "surgery" and sorted(spec.name for spec in info.layers) == ["a", "b"]
