"""Linear/Conv subclasses whose own forward calls ``F.linear`` / ``F.conv*d`` on the
module's weight and bias: matched in the graph and exact (float64 against ``torch.func``
``vmap(grad)`` on the ORIGINAL model; the TENGraD step against the dense block solve); a
forward that transforms the weight falls back, naming that."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import StdConv2d

import tengrad_fx
from tengrad_fx import TENGraD
from testing import check_covered_layers, check_tengrad_step

TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class ScaledLinear(nn.Linear):
    """F.linear on its own weight and bias, then a scale and an activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(F.linear(x, self.weight, self.bias) * 0.5)


class PadConv(nn.Conv2d):
    """Pads asymmetrically itself, then F.conv2d with its own stride/dilation/groups."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(F.pad(x, (1, 0, 1, 0), mode="replicate"), self.weight, self.bias, self.stride,
                        0, self.dilation, self.groups)


class SameConv1d(nn.Conv1d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(x, self.weight, None, 1, "same", 2)


class TransformedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * 2.0, self.bias)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = PadConv(2, 4, 3, stride=2, groups=2)
        self.conv1d = SameConv1d(4, 3, 4, bias=False)
        self.lin = ScaledLinear(3 * 16, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(2)  # [m, 4, 16]
        h = self.conv1d(h)  # [m, 3, 16]
        return self.head(self.lin(h.flatten(1)))


def _setup(seed: int, m: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    net = Net().double()
    orig = copy.deepcopy(net)
    x = torch.randn(m, 2, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (m,))
    return net, orig, x, y


def test_overriding_subclasses_are_matched_and_exact() -> None:
    net, orig, x, y = _setup(0, 4)
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback, info.fallback
    assert {s.name: s.kind for s in info.layers} == {"conv": "conv2d", "conv1d": "conv1d", "lin": "linear",
                                                     "head": "linear"}
    assert rel(prepared(x), orig(x)) <= 1e-14
    check_covered_layers(orig, prepared, x, y)


def test_tengrad_step_with_overriding_subclasses_is_exact() -> None:
    net, orig, x, y = _setup(1, 5)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(model, opt, orig, x, y, 0.05)


def test_transformed_weight_falls_back_with_reason() -> None:
    net = nn.Sequential(TransformedLinear(3, 4), nn.Tanh(), StdConv2d(2, 2, 1), nn.Flatten(), nn.Linear(32, 2))
    x = torch.randn(2, 2, 4, 3)
    prepared = tengrad_fx.prepare(net, example_inputs=(x,))
    fb = tengrad_fx.get_info(prepared).fallback
    for n in ("0.weight", "0.bias", "2.weight"):
        assert "overrides" in fb[n] and "transformed" in fb[n], fb[n]
    assert set(tengrad_fx.get_info(prepared).covered) == {"4.weight", "4.bias"}
    torch.testing.assert_close(prepared(x), net(x), rtol=0, atol=0)
