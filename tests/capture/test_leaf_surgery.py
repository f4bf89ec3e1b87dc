"""Covered modules inside a module the fx graph keeps as a leaf (an untraceable forward,
timm's notrace attention): captured by module surgery under the graph's store, exact;
one whose weight is only used functionally falls back with the reason."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tengrad_fx import get_info, prepare, report
from testing.oracle import check_covered_layers

from ._helpers import prepared_sandwich


timm_fx = pytest.importorskip("timm.layers._fx")


@timm_fx.register_notrace_module  # a leaf of the fx graph, as timm's attention modules are
class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.v = nn.Conv1d(4, 4, 1)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        n = int(x.shape[1])  # torch.fx cannot trace this
        a = torch.softmax(self.q(x) @ x.transpose(1, 2) / n, -1)
        v = self.v(x.transpose(1, 2)).transpose(1, 2)
        return a @ v + F.linear(x, self.unused.weight)


def test_layers_inside_a_leaf_are_covered_and_exact() -> None:
    prepared, orig, x, y = prepared_sandwich(Untraceable())
    info = get_info(prepared)
    assert info.method.startswith("fx")
    for name in ("mid.q", "mid.v"):
        assert info.covered[f"{name}.weight"] == name
    assert "inside a leaf module or used functionally" in info.fallback["mid.unused.weight"]
    assert "mid.unused.bias" in info.fallback
    check_covered_layers(orig, prepared, x, y)


@pytest.mark.slow
def test_timm_efficientvit_cascaded_attention() -> None:
    import timm

    model = timm.create_model("efficientvit_m0", pretrained=False, num_classes=10)
    prepared = prepare(model, example_inputs=(torch.randn(2, 3, 224, 224),))
    assert report(prepared).fraction_params >= 0.99
