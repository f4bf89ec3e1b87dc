"""Paper models and the timm/torchvision bridges of ``zoo.get_model``."""

from __future__ import annotations

import operator
from typing import Any

import pytest
import torch
from torch import nn

from tengrad_fx.zoo import PARAM_COUNTS, get_model
from tengrad_fx.zoo.models.densenet import Bottleneck, Transition
from tengrad_fx.zoo.models.mobilenetv2 import InvertedResidual
from tengrad_fx.zoo.models.wrn import WideBasicBlock

PAPER = ["3c1f", "wrn-28-4", "densenet-19", "mobilenetv2"]


def _input(name: str, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if name == "3c1f":
        return torch.randn(batch, 1, 28, 28, generator=g)
    return torch.randn(batch, 3, 32, 32, generator=g)


def _convs(model: nn.Module) -> list[nn.Conv2d]:
    return [m for m in model.modules() if isinstance(m, nn.Conv2d)]


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    torch.manual_seed(0)
    return {name: get_model(name) for name in PAPER}


@pytest.mark.parametrize("name", PAPER)
def test_forward_backward(models: dict[str, Any], name: str) -> None:
    model = models[name]
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(_input(name))
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname


@pytest.mark.parametrize("name", PAPER)
def test_param_count(models: dict[str, Any], name: str) -> None:
    assert _n_params(models[name]) == PARAM_COUNTS[name]


def test_param_count_table() -> None:
    assert PARAM_COUNTS == {
        "3c1f": 5_485_958,
        "3c1f-bn": 5_486_726,  # 3c1f + a BatchNorm2d(128) after each conv (the norm-layer training check)
        "wrn-28-4": 5_849_050,
        "densenet-19": 2_939_610,
        "mobilenetv2": 2_296_922,
    }


@pytest.mark.parametrize("name", PAPER)
def test_fx_traceable_and_modules_used_once(models: dict[str, Any], name: str) -> None:
    model = models[name].eval()
    gm = torch.fx.symbolic_trace(model)
    x = _input(name)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert len(targets) == len(set(targets)), "a module is called more than once"
    # every parameterised / activation layer is a module call; only residual adds and concats are functions
    functions = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert functions <= {operator.add, torch.cat}, functions
    # every leaf module (all are torch.nn layers) appears in the graph exactly once
    leaves = {q for q, m in model.named_modules() if not list(m.children())}
    assert set(targets) == leaves


def test_3c1f_structure(models: dict[str, Any]) -> None:
    model = models["3c1f"]
    leaves = [m for m in model.modules() if not list(m.children())]
    kinds = [type(m).__name__ for m in leaves]
    assert kinds == [
        *("Conv2d", "ReLU") * 3,
        *("MaxPool2d", "Flatten"),
        *("Linear", "ReLU", "Linear"),
    ]
    convs = _convs(model)
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (1, 128, (3, 3), (1, 1)),
        (128, 128, (3, 3), (1, 1)),
        (128, 128, (3, 3), (1, 1)),
    ]
    assert all(c.bias is not None for c in convs)
    pool = next(m for m in leaves if isinstance(m, nn.MaxPool2d))
    assert pool.kernel_size == 3 and pool.stride == 3
    fc1, fc2 = (m for m in leaves if isinstance(m, nn.Linear))
    assert (fc1.in_features, fc1.out_features) == (9 * 9 * 128, 500) == (10368, 500)
    assert (fc2.in_features, fc2.out_features) == (500, 10)


def test_wrn_structure(models: dict[str, Any]) -> None:
    model = models["wrn-28-4"]
    convs = _convs(model)
    convs3 = [c for c in convs if c.kernel_size == (3, 3)]
    convs1 = [c for c in convs if c.kernel_size == (1, 1)]
    assert len(convs3) == 25 and len(convs1) == 3 and len(convs) == 28
    assert all(c.bias is None for c in convs)
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 25
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())  # dropout 0 by default
    blocks = [m for m in model.modules() if isinstance(m, WideBasicBlock)]
    assert len(blocks) == 12
    stages = [model.stage1, model.stage2, model.stage3]
    assert [len(s) for s in stages] == [4, 4, 4]
    assert [s[-1].conv2.out_channels for s in stages] == [64, 128, 256]
    assert [s[0].conv1.stride for s in stages] == [(1, 1), (2, 2), (2, 2)]
    assert [s[0].shortcut.in_channels for s in stages] == [16, 64, 128]
    assert all(b.shortcut is None for s in stages for b in list(s)[1:])
    assert model.conv1.out_channels == 16 and model.fc.in_features == 256
    # pre-activation: the first layer of each block is BatchNorm on the block input
    assert all(isinstance(next(iter(b.children())), nn.BatchNorm2d) for b in blocks)
    dropped: Any = get_model("wrn-28-4", dropout=0.3)
    assert isinstance(dropped.stage1[0].dropout, nn.Dropout)


def test_densenet_structure(models: dict[str, Any]) -> None:
    model = models["densenet-19"].eval()
    assert model.layers_per_block == (19 - 4) // 6 == 2
    layers = [m for m in model.modules() if isinstance(m, Bottleneck)]
    assert len(layers) == 6
    assert all(b.conv1.out_channels == 400 and b.conv2.out_channels == 100 for b in layers)
    assert model.conv1.out_channels == 200
    trans = [m for m in model.modules() if isinstance(m, Transition)]
    assert [(t.conv.in_channels, t.conv.out_channels) for t in trans] == [(400, 200), (400, 200)]
    assert len(_convs(model)) == 15 and model.fc.in_features == 400
    # each bottleneck concatenates its input with 100 new channels
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [b.register_forward_hook(lambda m, i, o: seen.append((i[0], o))) for b in layers]
    try:
        with torch.no_grad():
            model(_input("densenet-19"))
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 6
    for inp, out in seen:
        assert out.shape[1] == inp.shape[1] + 100
        assert torch.equal(out[:, : inp.shape[1]], inp)
    assert [o.shape[-1] for _, o in seen] == [32, 32, 16, 16, 8, 8]


def test_mobilenetv2_structure(models: dict[str, Any]) -> None:
    model = models["mobilenetv2"].eval()
    blocks = [m for m in model.modules() if isinstance(m, InvertedResidual)]
    assert len(blocks) == 17
    depthwise = [c for c in _convs(model) if c.groups > 1]
    assert len(depthwise) == 17
    for c in depthwise:
        assert c.groups == c.in_channels == c.out_channels and c.kernel_size == (3, 3)
    assert [c.stride for c in depthwise].count((2, 2)) == 3
    assert all(b.conv2 is dw for b, dw in zip(blocks, depthwise, strict=True))
    assert model.conv1.stride == (1, 1) and model.conv1.out_channels == 32
    assert (model.conv2.in_channels, model.conv2.out_channels) == (320, 1280)
    widths = [16] + [24] * 2 + [32] * 3 + [64] * 4 + [96] * 3 + [160] * 3 + [320]
    assert [b.conv3.out_channels for b in blocks] == widths
    assert [b.conv1.out_channels // b.conv1.in_channels for b in blocks] == [1] + [6] * 16
    shapes: list[torch.Size] = []
    hook = model.layers.register_forward_hook(lambda m, i, o: shapes.append(o.shape))
    try:
        with torch.no_grad():
            model(_input("mobilenetv2"))
    finally:
        hook.remove()
    assert shapes == [torch.Size([2, 320, 4, 4])]


def test_in_chans_and_num_classes() -> None:
    assert _convs(get_model("3c1f"))[0].in_channels == 1
    m: Any = get_model("3c1f", num_classes=7, in_chans=3)
    assert _convs(m)[0].in_channels == 3
    assert m(torch.randn(1, 3, 28, 28)).shape == (1, 7)
    m = get_model("MobileNetV2", num_classes=100)
    assert _convs(m)[0].in_channels == 3 and m.fc.out_features == 100


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ValueError) as info:
        get_model("resnet-1000")
    msg = str(info.value)
    for name in [*PAPER, "timm:", "torchvision:"]:
        assert name in msg
    with pytest.raises(ValueError, match="timm"):
        get_model("timm:not_a_model_xyz")
    with pytest.raises(ValueError, match="torchvision"):
        get_model("torchvision:not_a_model_xyz")


@pytest.mark.parametrize("name", ["timm:resnet18", "torchvision:resnet18"])
def test_library_resnet18_one_channel(name: str) -> None:
    torch.manual_seed(0)
    model = get_model(name, num_classes=10, in_chans=1)
    first = _convs(model)[0]
    assert first.in_channels == 1
    assert (first.kernel_size, first.stride, first.padding, first.out_channels) == ((7, 7), (2, 2), (3, 3), 64)
    out = model(torch.randn(2, 1, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    assert first.weight.grad is not None


def test_torchvision_default_channels_untouched() -> None:
    model: Any = get_model("torchvision:resnet18", num_classes=5)
    assert model.conv1.in_channels == 3 and model.fc.out_features == 5


def test_timm_img_size_passthrough() -> None:
    model = get_model("timm:vit_tiny_patch16_224", num_classes=10, img_size=32)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_3c1f_bn_structure() -> None:
    model = get_model("3c1f-bn")
    kinds = [type(m).__name__ for m in model.modules() if not list(m.children())]
    assert kinds == [*("Conv2d", "BatchNorm2d", "ReLU") * 3, "MaxPool2d", "Flatten", "Linear", "ReLU", "Linear"]
    assert _n_params(model) == PARAM_COUNTS["3c1f-bn"]
