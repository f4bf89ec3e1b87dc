"""ConvTranspose1d/2d/3d: per-sample gradients, every Gram strategy, jvp and vjp against
the explicit J of torch.func in float64 (hypothesis over stride, padding, output_padding,
dilation, groups, bias, dtype: ``testing.fuzz_layers``), and the capture op's
outputs/gradients against the plain layer."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings

import tengrad_fx
from testing.fuzz_layers import SETTINGS, build_layer_case, check_layer, layer_cases

@settings(max_examples=100, **SETTINGS)
@given(layer_cases(kinds=("convT1d", "convT2d", "convT2d", "convT3d")))
def test_conv_transpose(case: dict[str, Any]) -> None:
    model, x = build_layer_case(case)
    check_layer(model, x, case["reduction"], case["seed"], case["x_grad"], case["in_backward"])


@pytest.mark.parametrize("in_backward", [False, True])
def test_capture_op_matches_plain_layer_and_cost_model(in_backward: bool) -> None:
    """Outputs, input and parameter gradients equal the plain ConvTranspose2d's, with the
    per-sample gradients materialized in backward or not; dims follow the cost model with
    S = input positions, f = (c_out/g)·Πk, o = c_in/g."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.ConvTranspose2d(4, 6, (3, 2), stride=(2, 3), padding=(1, 0),
                                           output_padding=(1, 2), dilation=(1, 2), groups=2),
                        nn.Tanh()).double()
    orig = copy.deepcopy(net)
    x = torch.randn(3, 4, 5, 4, dtype=torch.float64, requires_grad=True)
    x0 = x.detach().clone().requires_grad_(True)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(model)
    if in_backward:
        info.store.jacobian_sites = set(info.layers[0].sites)
    out = model(x)
    ref = orig(x0)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    out.square().sum().backward()
    ref.square().sum().backward()
    torch.testing.assert_close(x.grad, x0.grad, rtol=1e-12, atol=1e-13)
    for p, q in zip(model.parameters(), orig.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-13)
    (layer,) = tengrad_fx.covered_layers(model)
    assert layer.materialized == in_backward
    assert layer.dims() == (2, 5 * 4, 3 * 3 * 2, 2)


class OutputSize(nn.Module):
    """``up(x, output_size=...)``: torch picks output_padding from the requested size."""

    def __init__(self, traceable: bool) -> None:
        super().__init__()
        self.traceable = traceable
        self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)
        self.out = nn.Conv2d(2, 2, 1)

    def forward(self, x):
        if not self.traceable and x.abs().sum() > 0:  # data-dependent: fx cannot trace it
            x = x * 1.0
        return self.out(torch.tanh(self.up(x, output_size=[2 * x.shape[2], 2 * x.shape[3]])))


def _loop_reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    rows: dict[str, list[torch.Tensor]] = {k: [] for k, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        (torch.tanh(model(x[i:i + 1])) * y[i:i + 1]).sum().backward()
        for k, p in model.named_parameters():
            rows[k].append(p.grad.clone())
    return {k: torch.stack(v) for k, v in rows.items()}


@pytest.mark.parametrize("traceable", [True, False])
def test_output_size_call(traceable: bool) -> None:
    """fx and surgery path (untraceable model): output_padding is derived from output_size
    at run time, as torch does, and the layer stays exact."""
    torch.manual_seed(0)
    net = OutputSize(traceable).double()
    orig = copy.deepcopy(net)
    x = torch.randn(3, 3, 4, 5, dtype=torch.float64)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(model)
    torch.testing.assert_close(model(x), orig(x), rtol=0, atol=0)
    assert info.method == ("fx" if traceable else "surgery")
    assert info.fallback == {}
    y = torch.randn(3, 2, 8, 10, dtype=torch.float64)
    ref = _loop_reference(orig, x, y)
    (torch.tanh(model(x)) * y).sum().backward()
    layer = {lay.name: lay for lay in tengrad_fx.covered_layers(model)}["up"]
    dW, db = layer.per_sample_grads()
    loss_scale = 3.0  # loss_reduction="mean": the summed loss's per-sample grads are m times smaller
    torch.testing.assert_close(dW, ref["up.weight"] * loss_scale, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(db, ref["up.bias"] * loss_scale, rtol=1e-10, atol=1e-12)
