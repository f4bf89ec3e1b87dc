"""prepare() on a bare layer as the whole model, and on models called with dicts, nested
tuples/lists and dataclasses: covered, same Parameters, exact in float64."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import tengrad_fx
from tengrad_fx import covered_layers, get_info, prepare
from tengrad_fx.capture.folded_rows import FOLDS

from ._helpers import check_gram, check_psg, loop_psg, sq_loss

# --------------------------------------------------------------------------- bare layer as the model
ROOTS = {
    "linear": (nn.Linear, dict(in_features=7, out_features=4), (7,)),
    "linear_nobias_seq": (nn.Linear, dict(in_features=5, out_features=3, bias=False), (4, 5)),
    "conv1d_same_groups": (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=4, padding="same",
                                           groups=2), (4, 9)),
    "conv1d_valid_nobias": (nn.Conv1d, dict(in_channels=3, out_channels=2, kernel_size=3, padding="valid",
                                            bias=False), (3, 8)),
    "conv2d_same": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding="same"), (3, 6, 5)),
    "conv2d_valid_groups_nobias": (nn.Conv2d, dict(in_channels=4, out_channels=4, kernel_size=(2, 3),
                                                   padding="valid", groups=4, bias=False), (4, 6, 7)),
    "conv2d_stride_reflect": (nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=3, stride=2,
                                              padding=1, padding_mode="reflect"), (2, 7, 6)),
    "conv3d_same_groups": (nn.Conv3d, dict(in_channels=2, out_channels=4, kernel_size=2, padding="same",
                                           groups=2), (2, 4, 3, 5)),
    "conv_transpose2d_groups": (nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3, stride=2,
                                                         padding=1, output_padding=1, groups=2), (4, 3, 4)),
    "conv_transpose1d_nobias": (nn.ConvTranspose1d, dict(in_channels=2, out_channels=3, kernel_size=2,
                                                         dilation=2, bias=False), (2, 5)),
    "conv3d_valid_nobias": (nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=(2, 1, 2),
                                            bias=False), (2, 3, 4, 3)),
}


@pytest.mark.parametrize("case", list(ROOTS))
@pytest.mark.parametrize("with_examples", [True, False])
def test_bare_layer_as_model_is_covered_and_exact(case: str, with_examples: bool) -> None:
    cls, kw, shape = ROOTS[case]
    torch.manual_seed(0)
    layer = cls(**kw).double()
    orig = copy.deepcopy(layer)
    params = dict(layer.named_parameters())
    keys = list(layer.state_dict())
    x = torch.randn(4, *shape, dtype=torch.float64)
    prepared = prepare(layer, example_inputs=(x[:2],) if with_examples else None)
    info = get_info(prepared)
    assert info.fallback == {}
    assert set(info.covered) == set(params)
    assert [lay.name for lay in covered_layers(prepared)] == [""]
    assert list(prepared.state_dict()) == keys
    assert all(p is params[k] for k, p in prepared.named_parameters())
    assert "(root)" in str(tengrad_fx.report(prepared))
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    y = torch.randn_like(orig(x))
    ref = check_psg(prepared, orig, x, y)
    check_gram(prepared, ref)
    # the batch gradient is the plain layer's
    orig.zero_grad()
    sq_loss(orig(x), y).backward()
    for k, p in prepared.named_parameters():
        torch.testing.assert_close(p.grad, dict(orig.named_parameters())[k].grad, rtol=1e-12, atol=1e-14)


def test_bare_layer_subclass_overriding_forward_falls_back() -> None:
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    with pytest.raises(ValueError, match=r"no nn\.Linear.*Scaled overrides Linear\.forward"):
        prepare(Scaled(3, 2), example_inputs=(torch.randn(2, 3),))


@pytest.mark.parametrize("mod, shape", [(nn.BatchNorm2d(3), (3, 5, 5)), (nn.LayerNorm(5), (7, 5))])
def test_bare_norm_layer_is_not_a_root_capture_module(mod, shape) -> None:
    """A bare norm layer is traced as usual (no one-op root graph): it runs exactly, and
    each parameter is covered and exact (eval mode) or falls back with a reason."""
    torch.manual_seed(0)
    mod = mod.double().eval()
    x = torch.randn(4, *shape, dtype=torch.float64)
    orig = copy.deepcopy(mod)
    prepared = prepare(mod, example_inputs=(x[:2],))
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    info = get_info(prepared)
    assert set(info.covered) | set(info.fallback) == {"weight", "bias"}
    assert all(info.fallback.values())
    if covered_layers(prepared):
        check_psg(prepared, orig, x, torch.randn(4, *shape, dtype=torch.float64))


# --------------------------------------------------------------------------- dict / nested inputs
class DictNet(nn.Module):
    """Called as ``model({"img": [B,2,5,5], "feat": [B,3], "mask": [5,5] (no batch dim),
    "scale": 0.5})``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc_feat = nn.Linear(3, 4)
        self.head = nn.Linear(3 * 25 + 4, 2)

    def forward(self, batch):
        h = torch.tanh(self.conv(batch["img"])) * batch["mask"]
        f = torch.tanh(self.fc_feat(batch["feat"])) * batch["scale"]
        return self.head(torch.cat([h.flatten(1), f], 1))


class NestedNet(nn.Module):
    """Called as ``model((a, [b, {"c": c}]))``: a tuple holding a list holding a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.fa = nn.Linear(3, 4)
        self.fb = nn.Linear(2, 4, bias=False)
        self.fc = nn.Conv1d(1, 4, 3)
        self.out = nn.Linear(4, 2)

    def forward(self, inputs):
        a, (b, d) = inputs
        h = self.fa(a) + self.fb(b) + self.fc(d["c"]).mean(2)
        return self.out(torch.tanh(h))


def _dict_batch(m: int):
    torch.manual_seed(1)
    return {"img": torch.randn(m, 2, 5, 5, dtype=torch.float64), "feat": torch.randn(m, 3, dtype=torch.float64),
            "mask": (torch.rand(5, 5) > 0.3).double(), "scale": 0.5}


def _nested_batch(m: int):
    torch.manual_seed(2)
    return (torch.randn(m, 3, dtype=torch.float64),
            [torch.randn(m, 2, dtype=torch.float64), {"c": torch.randn(m, 1, 6, dtype=torch.float64)}])


@pytest.mark.parametrize("cls, make", [(DictNet, _dict_batch), (NestedNet, _nested_batch)])
@pytest.mark.parametrize("with_examples", [True, False])
def test_dict_and_nested_inputs_are_covered_and_exact(cls, make, with_examples: bool) -> None:
    torch.manual_seed(0)
    model = cls().double()
    orig = copy.deepcopy(model)
    x = make(4)
    ex = make(3) if with_examples else None  # the example batch size need not be the training one
    prepared = prepare(model, example_inputs=(ex,) if ex is not None else None)
    info = get_info(prepared)
    assert info.fallback == {}, info.fallback
    assert set(info.covered) == {k for k, _ in orig.named_parameters()}
    assert all(spec.input_shapes for spec in info.layers) == with_examples
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    ref = check_psg(prepared, orig, x, torch.randn(4, 2, dtype=torch.float64))
    check_gram(prepared, ref)


def test_nested_input_folded_layer_still_detected() -> None:
    """The probes resize and perturb nested leaves, so a layer whose rows are a folded batch
    is still found (and covered by its per-sample rows)."""

    class FoldedDict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)
            self.out = nn.Linear(5, 2)

        def forward(self, batch):
            x = batch["seq"]
            h = self.fc(x.reshape(-1, 4)).reshape(x.shape[0], -1, 5)
            return self.out(torch.tanh(h).mean(1))

    x = {"seq": torch.randn(3, 6, 4)}
    prepared = prepare(FoldedDict(), example_inputs=(x,))
    info = get_info(prepared)
    assert not info.fallback and [lay.name for lay in covered_layers(prepared)] == ["fc", "out"]
    assert FOLDS[(info.store.key, info.layers[0].sites[0])] == (1, 6)  # sample i: rows 6i .. 6i+5
    p2 = prepare(FoldedDict())  # no example_inputs: the run-time check sees the dict's batch
    with pytest.raises(RuntimeError, match="'fc'"):
        p2(x)


@dataclasses.dataclass
class Batch:
    img: torch.Tensor
    feat: torch.Tensor
    tag: str = "train"


@dataclasses.dataclass
class RegisteredBatch:
    img: torch.Tensor
    feat: torch.Tensor


pytree.register_dataclass(RegisteredBatch)


class DataclassNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(3, 3)
        self.out = nn.Linear(3 * 9 + 3, 2)

    def forward(self, batch):
        h = torch.tanh(self.conv(batch.img)).flatten(1)
        return self.out(torch.cat([h, torch.tanh(self.fc(batch.feat))], 1))


@pytest.mark.parametrize("registered", [True, False])
def test_dataclass_inputs_are_covered_and_exact(registered: bool) -> None:
    torch.manual_seed(0)
    model = DataclassNet().double()
    orig = copy.deepcopy(model)
    cls = RegisteredBatch if registered else Batch
    x = cls(torch.randn(4, 2, 5, 5, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    prepared = prepare(model, example_inputs=(cls(x.img[:2], x.feat[:2]),))
    assert get_info(prepared).fallback == {}
    y = torch.randn(4, 2, dtype=torch.float64)
    if registered:
        check_psg(prepared, orig, x, y)
    else:  # an unregistered dataclass is a pytree leaf: vmap cannot split it, loop instead
        ref = loop_psg(orig, x, y, take=lambda b, i: dataclasses.replace(b, img=b.img[i:i + 1],
                                                                          feat=b.feat[i:i + 1]))
        check_psg(prepared, orig, x, y, ref=ref)

