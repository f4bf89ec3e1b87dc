"""Fuzz: random small models (covered layers plus norms, pooling, residual adds, in-place
activations), one TENGraD step against dense block NGD in float64.

See :mod:`testing.fuzz_models`. The default run takes a fixed-seed (derandomized) subset;
``-m slow`` runs 200 further models. The ``compiled`` tests capture through
``torch.compile`` (inductor on CPU), draw mostly ReLU activations (plain and in place)
and in-place residual adds,
and also check the records against eager.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import event, given, settings

from testing.fuzz_layers import SETTINGS
from testing.fuzz_models import check_step, model_cases


def _run(case: dict[str, Any], compiled: bool = False) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only contends (badly on a loaded machine)
    try:
        counts = check_step(case, compiled=compiled)
    finally:
        torch.set_num_threads(threads)
    event(f"family {case['family']}")
    event(f"covered layers {counts['covered']}")
    event(f"has fallback parameters {counts['fallback'] > 0}")
    blocks = case["blocks"] + [b["residual"] for b in case["blocks"] if b["residual"] is not None]
    event(f"has ReLU {any(b['act'] == 'relu' for b in blocks)}")
    event(f"has in-place ReLU {any(b['act'] == 'relu_' for b in blocks)}")
    event(f"has in-place residual add {any(b.get('inplace_add', False) for b in blocks)}")


@settings(max_examples=40, **SETTINGS)
@given(model_cases())
def test_model_fuzz(case: dict[str, Any]) -> None:
    _run(case)


@pytest.mark.slow
@settings(max_examples=200, **SETTINGS)
@given(model_cases())
def test_model_fuzz_long(case: dict[str, Any]) -> None:
    _run(case)


@settings(max_examples=4, **SETTINGS)
@given(model_cases(compile_hazards=True))
def test_model_fuzz_compiled(case: dict[str, Any]) -> None:
    _run(case, compiled=True)


@pytest.mark.slow
@settings(max_examples=60, **SETTINGS)
@given(model_cases(compile_hazards=True))
def test_model_fuzz_compiled_long(case: dict[str, Any]) -> None:
    _run(case, compiled=True)
