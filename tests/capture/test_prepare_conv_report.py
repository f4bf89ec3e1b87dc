"""prepare(): every conv padding flavour against the torch.func oracle in float64;
error messages; the coverage report."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx import capturing, covered_layers, get_info, prepare

from ._helpers import CNN, MLP, Dual, TiedLM, Untraceable, WithSubclasses, check_psg, sq_loss


# --------------------------------------------------------------------------- conv paddings
CONVS = {
    "2d_same_even_kernel": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=4, padding="same")),
    "2d_same_even_dilated": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=(2, 3),
                                             dilation=(3, 1), padding="same")),
    "2d_same_reflect_even": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=(4, 2),
                                             padding="same", padding_mode="reflect")),
    "2d_reflect": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=2,
                                   padding_mode="reflect")),
    "2d_circular_tuple": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=(1, 2),
                                          padding_mode="circular")),
    "2d_replicate": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding=1,
                                     padding_mode="replicate")),
    "2d_stride_dilation": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=2,
                                           dilation=2, padding=(1, 3))),
    "2d_stride_tuple": (nn.Conv2d, dict(in_channels=3, out_channels=5, kernel_size=(3, 2),
                                        stride=(2, 3), padding=(0, 1))),
    "2d_groups": (nn.Conv2d, dict(in_channels=6, out_channels=9, kernel_size=3, padding=1, groups=3)),
    "2d_depthwise": (nn.Conv2d, dict(in_channels=4, out_channels=8, kernel_size=3, groups=4, stride=2)),
    "2d_valid_nobias": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, padding="valid",
                                        bias=False)),
    "2d_1x1": (nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=1)),
    "1d": (nn.Conv1d, dict(in_channels=3, out_channels=4, kernel_size=5, stride=2, padding=2)),
    "1d_same_reflect_even": (nn.Conv1d, dict(in_channels=2, out_channels=3, kernel_size=4, padding="same",
                                             padding_mode="reflect")),
    "1d_groups_dilated_nobias": (nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, dilation=2,
                                                 groups=2, bias=False)),
    "3d": (nn.Conv3d, dict(in_channels=2, out_channels=4, kernel_size=(3, 2, 3), stride=(1, 2, 1),
                           padding=(1, 0, 1), groups=2)),
    "3d_same_circular_even": (nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=2, padding="same",
                                              padding_mode="circular")),
    "3d_same_zeros_nobias": (nn.Conv3d, dict(in_channels=2, out_channels=3, kernel_size=(2, 3, 4),
                                             padding="same", bias=False)),
}
SPATIAL = {nn.Conv1d: (11,), nn.Conv2d: (9, 8), nn.Conv3d: (5, 6, 4)}


class ConvNet(nn.Module):
    def __init__(self, cls, kw, spatial) -> None:
        super().__init__()
        self.conv = cls(**kw)
        with torch.no_grad():
            n = self.conv(torch.zeros(1, kw["in_channels"], *spatial)).numel()
        self.fc = nn.Linear(n, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


@pytest.mark.parametrize("case", list(CONVS))
def test_conv_per_sample_grads_every_padding(case: str) -> None:
    cls, kw = CONVS[case]
    spatial = SPATIAL[cls]
    torch.manual_seed(0)
    model = ConvNet(cls, kw, spatial).double()
    orig = copy.deepcopy(model)
    x = torch.randn(3, kw["in_channels"], *spatial, dtype=torch.float64)
    prepared = prepare(model, example_inputs=(x[:2],))
    assert {layer.name for layer in covered_layers(prepared)} == {"conv", "fc"}
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=1e-14)
    y = torch.randn(3, 3, dtype=torch.float64)
    check_psg(prepared, orig, x, y, tol=1e-10)
    # batch gradient identical to the unprepared model's
    orig.zero_grad()
    sq_loss(orig(x), y).backward()
    for (_k, p), q in zip(prepared.named_parameters(), orig.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        prepare(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"no nn\.Linear or nn\.Conv"):
        prepare(nn.Sequential(nn.PReLU(3), nn.ReLU()))
    with pytest.raises(ValueError, match="loss_reduction"):
        prepare(MLP(), loss_reduction="avg")  # type: ignore[arg-type]
    prepared = prepare(MLP(), example_inputs=(torch.randn(2, 6),))
    with pytest.raises(ValueError, match="already prepared"):
        prepare(prepared)
    surg = prepare(Untraceable(), example_inputs=(torch.randn(2, 6),))
    with pytest.raises(ValueError, match="already prepared"):
        prepare(surg, example_inputs=(torch.randn(2, 6),))
    plain = MLP()
    for fn in (covered_layers, tengrad_fx.report, get_info, capturing):
        with pytest.raises(ValueError, match=r"tengrad_fx\.prepare\(model\)"):
            fn(plain)
    with pytest.raises(TypeError, match="nn.Module"):
        get_info("model")  # type: ignore[arg-type]


def test_example_inputs_that_fail_raise_with_context() -> None:
    with pytest.raises(RuntimeError, match="example_inputs"):
        prepare(MLP(), example_inputs=(torch.randn(2, 5),))  # wrong feature size


# --------------------------------------------------------------------------- report
@pytest.mark.parametrize("cls", [CNN, TiedLM, Dual, WithSubclasses])
def test_report_lists_every_parameter(cls, capsys) -> None:
    torch.manual_seed(0)
    model = cls()
    ex = {CNN: torch.randn(2, 3, 8, 8), TiedLM: torch.randint(0, 11, (2, 4)),
          Dual: torch.randn(2, 6), WithSubclasses: torch.randn(2, 3, 5, 5)}[cls]
    prepared = prepare(model, example_inputs=(ex,))
    rep = tengrad_fx.report(prepared)
    print(rep)
    text = capsys.readouterr().out
    info = get_info(prepared)
    lines = text.splitlines()
    for k, _ in model.named_parameters():
        row = [ln for ln in lines if ln.split() and ln.split()[0] == k]
        assert len(row) == 1, k
        status = "covered" if k in info.covered else "fallback"
        assert row[0].split()[1] == status, row[0]
        if status == "fallback":
            assert info.fallback[k] in row[0]
    assert f"{rep.n_covered} covered, {rep.n_fallback} fallback" in text
    assert rep.n_covered + rep.n_fallback == len(list(model.parameters()))


