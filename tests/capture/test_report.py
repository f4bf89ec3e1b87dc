"""``tengrad_fx.report``: covered fraction by tensors and by parameter count, every
fallback listed with its reason."""
from __future__ import annotations

import torch
import torch.nn as nn

import tengrad_fx


def test_report_fractions_by_tensors_and_parameter_count() -> None:
    net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.PReLU(4), nn.Flatten(),
                        nn.Linear(16, 3))
    model = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 2, 4, 4),))
    rep = tengrad_fx.report(model)
    sizes = {n: p.numel() for n, p in net.named_parameters()}
    fallback = {"2.weight"}  # PReLU: no capture kernel
    assert rep.fallbacks.keys() == fallback and "no capture kernel" in rep.fallbacks["2.weight"]
    assert rep.params_total == sum(sizes.values())
    assert rep.params_covered == sum(v for k, v in sizes.items() if k not in fallback)
    assert rep.fraction_tensors == (len(sizes) - 1) / len(sizes)
    assert abs(rep.fraction_params - rep.params_covered / rep.params_total) < 1e-15
    text = str(rep)
    assert f"{100 * rep.fraction_params:.2f} % by parameter count" in text
    assert f"{100 * rep.fraction_tensors:.1f} % by tensors" in text
    assert "  - 2.weight (4): PReLU: no capture kernel" in text
    assert "BN: batch statistics held fixed" in text


def test_report_without_batchnorm_has_no_bn_note() -> None:
    model = tengrad_fx.prepare(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),
                               example_inputs=(torch.randn(2, 3),))
    rep = tengrad_fx.report(model)
    assert rep.fraction_params == 1.0 and not rep.fallbacks
    assert "BN:" not in str(rep)
