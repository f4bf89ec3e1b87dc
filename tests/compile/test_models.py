"""Whole models, compiled with inductor: the paper's four zoo models and timm/torchvision
models with ReLU, ReLU6 and Hardswish (in place, around every covered layer) record what
eager records, and their per-sample gradients add up to the compiled backward's own
parameter gradients. The zoo's 3C1F runs by default; the rest under ``-m slow`` (minutes of
compilation each on 2 cores; the small models of ``test_records.py`` cover the same ops)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.zoo.registry import get_model

from ._check import assert_same, snapshot

SLOW = [
    "wrn-28-4", "densenet-19", "mobilenetv2",  # the paper's (3C1F runs by default)
    "torchvision:resnet18", "torchvision:mobilenet_v2", "torchvision:mobilenet_v3_small",
    "torchvision:squeezenet1_1", "torchvision:shufflenet_v2_x0_5",
    "timm:mobilenetv3_small_050", "timm:resnet10t", "timm:lcnet_050",
]
# Inductor's Hardsigmoid/Hardswish backward in float64 rounds its 1/6 to float32 (2^-25
# relative), in the parameter gradients as much as in the records: eager vs compiled is
# compared to that, the records vs the compiled program's own gradients to 1e-12.
TOL_EAGER = 1e-6


def _check(name: str) -> None:
    torch.manual_seed(0)
    in_chans = 1 if name == "3c1f" else 3
    model = get_model(name, num_classes=5, in_chans=in_chans).double().eval()  # eval: samples independent
    size = 28 if name == "3c1f" else 32
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, in_chans, size, size, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 3, 4])
    snaps = []
    for compiled in (False, True):
        pm = tengrad_fx.prepare(copy.deepcopy(model), example_inputs=(x[:2],)).eval()
        F.cross_entropy((torch.compile(pm) if compiled else pm)(x), y).backward()
        snaps.append(snapshot(pm))
    assert_same(snaps[1], snaps[0], TOL_EAGER)
    for layer in tengrad_fx.covered_layers(pm):  # the compiled one
        dW, db = layer.per_sample_grads()
        for ps, p in ((dW, layer.weight), (db, layer.bias)):
            if p is not None:
                err = ((ps.mean(0) - p.grad).norm() / p.grad.norm().clamp_min(1e-300)).item()
                assert err <= 1e-12, (layer.name, err)


def test_3c1f() -> None:
    _check("3c1f")


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_model(name: str) -> None:
    _check(name)
