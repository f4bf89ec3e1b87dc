"""ConvTranspose1d/2d/3d: per-sample gradients, every Gram strategy, jvp and vjp against
the explicit J of torch.func in float64 (hypothesis over stride, padding, output_padding,
dilation, groups, bias), and the capture op's outputs/gradients against the plain layer."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import tengrad_fx
from test_gram_hypothesis import SETTINGS, check_layer

CLS = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@st.composite
def conv_transpose_cases(draw: Any) -> dict[str, Any]:
    nd = draw(st.sampled_from([1, 2, 2, 3]))
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(nd))
    # torch: output_padding < max(stride, dilation)
    output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    spatial = []
    for k, s, d, p, op in zip(kernel, stride, dilation, padding, output_padding):
        # output size (n-1)·s - 2p + d(k-1) + op + 1 >= 1
        lo = max(1, 1 + -(-(2 * p - d * (k - 1) - op) // s))
        spatial.append(draw(st.integers(lo, lo + (2 if nd == 3 else 4))))
    return dict(
        nd=nd, c_in=groups * draw(st.integers(1, 3)), c_out=groups * draw(st.integers(1, 3)),
        kernel=kernel, stride=stride, padding=padding, output_padding=output_padding,
        dilation=dilation, groups=groups, bias=draw(st.booleans()), spatial=tuple(spatial),
        m=draw(st.integers(1, 5)), reduction=draw(st.sampled_from(["sum", "mean"])),
        seed=draw(st.integers(0, 2**16)), x_grad=draw(st.booleans()), in_backward=draw(st.booleans()),
    )


def _layer(case: dict[str, Any]) -> nn.Module:
    torch.manual_seed(case["seed"])
    return CLS[case["nd"]](case["c_in"], case["c_out"], case["kernel"], stride=case["stride"],
                           padding=case["padding"], output_padding=case["output_padding"],
                           groups=case["groups"], bias=case["bias"], dilation=case["dilation"])


@settings(max_examples=100, **SETTINGS)
@given(conv_transpose_cases())
def test_conv_transpose(case: dict[str, Any]) -> None:
    layer = _layer(case)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["m"], case["c_in"], *case["spatial"], generator=g, dtype=torch.float64)
    check_layer(layer, x, case["reduction"], case["seed"], case["x_grad"], case["in_backward"])


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
