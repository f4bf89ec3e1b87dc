"""Fuzz: random small models (covered layers plus norms, pooling, residual adds, in-place
activations), one TENGraD step against dense block NGD in float64.

See :mod:`testing.fuzz_models`. The default run takes a fixed-seed (derandomized) subset;
``-m slow`` runs 200 further models.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import event, given, settings

from testing.fuzz_layers import SETTINGS
from testing.fuzz_models import check_step, model_cases


def _run(case: dict[str, Any]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only contends (badly on a loaded machine)
    try:
        counts = check_step(case)
    finally:
        torch.set_num_threads(threads)
    event(f"family {case['family']}")
    event(f"covered layers {counts['covered']}")
    event(f"has fallback parameters {counts['fallback'] > 0}")


@settings(max_examples=40, **SETTINGS)
@given(model_cases())
def test_model_fuzz(case: dict[str, Any]) -> None:
    _run(case)


@pytest.mark.slow
@settings(max_examples=200, **SETTINGS)
@given(model_cases())
def test_model_fuzz_long(case: dict[str, Any]) -> None:
    _run(case)
