"""``load_state_dict`` of TENGraD and the baselines refuses, with an error naming both
sides and the fix, a state dict of another optimizer kind, another parameter layout or
other materialization choices, and loads nothing then."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.baselines.kfac import KFAC
from tengrad_fx.optim.baselines.ngd import NGD


def _model(width: int = 6, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, width),
                        nn.ReLU(), nn.Linear(width, 3))
    return tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 1, 5, 5),))


def _trained(opt: torch.optim.Optimizer, model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 1, 5, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def _refuses(opt: torch.optim.Optimizer, sd: dict, match: str) -> None:
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    after = opt.state_dict()
    assert after.keys() == before.keys()
    assert repr(after["state"]) == repr(before["state"])  # nothing half-loaded


def test_round_trip_still_loads() -> None:
    m = _model()
    sd = _trained(TENGraD(m, lr=0.1, damping=0.1), m).state_dict()
    assert sd["tengrad_fx"]["optimizer"] == "TENGraD"
    opt = TENGraD(m, lr=0.1, damping=0.1)
    opt.load_state_dict(sd)
    assert opt.counters["step"] == 2


def test_torch_sgd_state_into_tengrad() -> None:
    m = _model()
    sgd = _trained(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m)
    _refuses(TENGraD(m, lr=0.1, damping=0.1), sgd.state_dict(),
             r"not saved by TENGraD.*'tengrad' counters.*dampening.*optimizer that saved it")


@pytest.mark.parametrize("src, dst", [("kfac", "tengrad"), ("tengrad", "kfac"), ("tengrad", "ngd"), ("ngd", "kfac")])
def test_other_kind(src: str, dst: str) -> None:
    make = {"tengrad": lambda m: TENGraD(m, lr=0.1, damping=0.1), "kfac": lambda m: KFAC(m, lr=0.1, damping=0.1),
            "ngd": lambda m: NGD(m, lr=0.1, damping=0.1)}
    names = {"tengrad": "TENGraD", "kfac": "KFAC", "ngd": "NGD"}
    m = _model()
    sd = _trained(make[src](m), m).state_dict()
    _refuses(make[dst](m), sd, rf"saved by {names[src]}, not {names[dst]}.*Build a {names[src]}")


@pytest.mark.parametrize("cls", [TENGraD, KFAC])
def test_other_model(cls: type) -> None:
    m6, m7 = _model(6), _model(7)
    sd = _trained(cls(m6, lr=0.1, damping=0.1), m6).state_dict()
    _refuses(cls(m7, lr=0.1, damping=0.1), sd, r"parameter layout differs \(parameter 2 is '3.weight' \(6, 100\) "
                                               r"in the state_dict but '3.weight' \(7, 100\) here")


def test_other_trainable_parameters() -> None:
    m = _model()
    sd = _trained(TENGraD(m, lr=0.1, damping=0.1), m).state_dict()
    dict(m.named_parameters())["0.bias"].requires_grad_(False)
    _refuses(TENGraD(m, lr=0.1, damping=0.1), sd, r"6 parameters were saved, this optimizer has 5.*requires_grad")


def test_other_materialization() -> None:
    m = _model()
    sd = _trained(TENGraD(m, lr=0.1, damping=0.1, strategy="materialize"), m).state_dict()
    assert sd["tengrad_fx"]["materialized"]  # every layer materialized
    _refuses(TENGraD(m, lr=0.1, damping=0.1, strategy="factor"), sd,
             r"materialization choices \(strategy='materialize' in the state_dict, 'factor' here\)")
    _refuses(TENGraD(m, lr=0.1, damping=0.1, strategy="materialize", jacobian_budget_mb=1.0), sd,
             r"jacobian_budget_mb=None in the state_dict, 1.0 here")
    bad = copy.deepcopy(sd)
    bad["tengrad_fx"]["materialized"] = ["no.such.layer"]
    _refuses(TENGraD(m, lr=0.1, damping=0.1, strategy="materialize"), bad,
             r"materializes layers \['no.such.layer'\], which are not covered layers of this model")


def test_not_a_state_dict() -> None:
    m = _model()
    _refuses(TENGraD(m, lr=0.1, damping=0.1), {"model": 1}, r"expected an optimizer state_dict")


def test_state_dict_without_the_record_still_loads() -> None:
    """A state dict saved before the record existed, with this optimizer's counters."""
    m = _model()
    sd = _trained(TENGraD(m, lr=0.1, damping=0.1), m).state_dict()
    del sd["tengrad_fx"]
    opt = TENGraD(m, lr=0.1, damping=0.1)
    opt.load_state_dict(sd)
    assert opt.counters["step"] == 2
