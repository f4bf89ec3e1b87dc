"""Parameters that are not module calls (class/position tokens, layer scales) and timm's
``Conv2dSame``: exact per-sample gradients against ``torch.func`` on the ORIGINAL model,
and the TENGraD update against the dense float64 solve."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers.conv2d_same import Conv2dSame

import tengrad_fx
from tengrad_fx import TENGraD
from testing import check_tengrad_step, per_sample_grads_reference

TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Tokens(nn.Module):
    """Patch Linear, class token (expand + cat), position embedding (add), layer scale
    (reshape + mul, twice: two uses of one parameter), head on the class token."""

    def __init__(self, n: int = 5, d: int = 6):
        super().__init__()
        self.embed = nn.Linear(4, d)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, d))
        self.gamma = nn.Parameter(torch.randn(d))
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1) + self.pos_embed
        h = h + torch.tanh(self.mix(h)) * self.gamma.reshape(1, 1, -1)
        h = h * self.gamma
        return self.head(h[:, 0])


def _check_psg(orig: nn.Module, prepared: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    F.cross_entropy(prepared(x), y).backward()
    ref = per_sample_grads_reference(orig, x, F.cross_entropy, y)
    names = {id(p): n for n, p in prepared.named_parameters()}
    for layer in tengrad_fx.covered_layers(prepared):
        dW, db = layer.per_sample_grads()
        assert rel(dW, ref[names[id(layer.weight)]]) <= TOL, layer.name
        if db is not None:
            assert rel(db, ref[names[id(layer.bias)]]) <= TOL, layer.name
        J = layer.jacobian()
        assert rel(layer.gram(), J @ J.T) <= TOL


def test_tokens_and_layer_scale_are_exact() -> None:
    torch.manual_seed(0)
    net = Tokens().double()
    orig = copy.deepcopy(net)
    x, y = torch.randn(4, 5, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 2])
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback, info.fallback
    kinds = {spec.name: (spec.kind, len(spec.sites)) for spec in info.layers}
    assert kinds["cls_token"] == ("param", 1) and kinds["gamma"] == ("param", 2)
    assert "added parameter" in str(tengrad_fx.report(prepared))
    _check_psg(orig, prepared, x, y)


def test_tengrad_update_with_added_parameters_is_exact() -> None:
    torch.manual_seed(1)
    net = Tokens().double()
    orig = copy.deepcopy(net)
    x, y = torch.randn(6, 5, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 2, 1, 0])
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(model, opt, orig, x, y, 0.05)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.proj = nn.Parameter(torch.randn(3, 3))  # used by matmul: no per-sample rule
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3))  # a + b: no batch dimension

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.proj + (self.a + self.b)


def test_added_parameter_fallback_reasons() -> None:
    prepared = tengrad_fx.prepare(_Odd(), example_inputs=(torch.randn(2, 3),))
    fb = tengrad_fx.get_info(prepared).fallback
    assert "matmul" in fb["proj"] and "no per-sample rule" in fb["proj"]
    assert "does not index samples" in fb["a"] and "no batch dimension" in fb["b"]
    assert "lin.weight" in tengrad_fx.get_info(prepared).covered


@pytest.mark.parametrize("hw", [(9, 7), (8, 8)])
def test_conv2d_same_is_covered_and_exact(hw: tuple[int, int]) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(Conv2dSame(2, 3, 3, stride=2), nn.Tanh(), Conv2dSame(3, 4, 2, dilation=2),
                        nn.Flatten(), nn.LazyLinear(3)).double()
    x = torch.randn(4, 2, *hw, dtype=torch.float64)
    net(x)  # materialize the lazy head
    orig = copy.deepcopy(net)
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback and {"0.weight", "2.weight"} <= set(info.covered)
    _check_psg(orig, prepared, x, torch.tensor([0, 1, 2, 1]))


def test_timm_tf_same_model_fully_covered() -> None:
    model = timm.create_model("tf_mobilenetv3_small_minimal_100", pretrained=False, num_classes=10)
    prepared = tengrad_fx.prepare(model, example_inputs=(torch.randn(2, 3, 32, 32),))
    assert tengrad_fx.report(prepared).fraction_params == 1.0
