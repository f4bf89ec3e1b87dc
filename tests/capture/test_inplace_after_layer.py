"""In-place ops on a captured layer's output (found by the model fuzz).

``F.linear`` on ``[m, T, d]`` and Conv1d return views of an intermediate; inside a custom
op autograd forbids in-place ops on such a view, so ``ReLU(inplace=True)`` or ``+=`` right
after the layer raised on the prepared model while the original ran. The capture ops now
return the result without the view relation; gradients and records must equal the
unprepared model's.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tengrad_fx


class AddInPlace(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.layer(x)
        y += x
        return y


CASES = {
    "linear-seq + relu_": (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)), (5, 3, 4)),
    "conv1d + relu_": (lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.ReLU(inplace=True)), (5, 2, 7)),
    "conv1d + leaky_": (lambda: nn.Sequential(nn.Conv1d(2, 4, 2, stride=2, groups=2), nn.LeakyReLU(0.1, inplace=True)),
                        (5, 2, 8)),
    "linear-seq += x": (lambda: AddInPlace(nn.Linear(4, 4)), (5, 3, 4)),
    "conv1d += x": (lambda: AddInPlace(nn.Conv1d(2, 2, 3, padding=1)), (5, 2, 6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inplace_after_captured_layer(name: str) -> None:
    make, shape = CASES[name]
    torch.manual_seed(0)
    net = make().double()
    ref = copy.deepcopy(net)
    x = torch.randn(*shape, dtype=torch.float64)
    R = torch.randn_like(ref(x))
    (ref(x) * R).sum().backward()
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],), loss_reduction="sum")
    (model(x) * R).sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-12), n
    (layer,) = tengrad_fx.covered_layers(model)
    dW, _ = layer.per_sample_grads()
    assert torch.allclose(dW.sum(0), layer.weight.grad, rtol=1e-12, atol=1e-12)
