"""Fuzz: random single-layer configurations, every curvature op against ``torch.func``.

See :mod:`testing.fuzz_layers` for the cases (kind, groups, stride, dilation, padding and
padding mode, bias, batch, positions, one or two calls, float32/float64, both capture
paths) and the check. The default run takes a fixed-seed (derandomized) subset; ``-m slow``
runs 1000 further examples. The ``compiled`` tests capture through ``torch.compile``
(inductor on CPU, a few seconds per example) and also check the records against eager.
"""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings

from testing.fuzz_layers import SETTINGS, build_layer_case, check_layer, layer_cases


def _run(case: dict[str, Any], compiled: bool = False) -> None:
    model, x = build_layer_case(case)
    check_layer(model, x, case["reduction"], case["seed"], case["x_grad"], case["in_backward"], compiled=compiled)
    event(f"kind {case['kind']}")
    event(f"ReLU before the layer, input grad on {case['relu_in'] and case['x_grad']}")


@settings(max_examples=250, **SETTINGS)
@given(layer_cases())
def test_layer_fuzz(case: dict[str, Any]) -> None:
    _run(case)


@pytest.mark.slow
@settings(max_examples=1000, **SETTINGS)
@given(layer_cases())
def test_layer_fuzz_long(case: dict[str, Any]) -> None:
    _run(case)


@settings(max_examples=10, **SETTINGS)
@given(layer_cases())
def test_layer_fuzz_compiled(case: dict[str, Any]) -> None:
    _run(case, compiled=True)


@pytest.mark.slow
@settings(max_examples=150, **SETTINGS)
@given(layer_cases())
def test_layer_fuzz_compiled_long(case: dict[str, Any]) -> None:
    _run(case, compiled=True)
