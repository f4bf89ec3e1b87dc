"""What a captured layer call adds to the plain layer's forward + backward, in aten ops.

On a GPU a covered layer call is launch-bound: every aten op the capture adds is host
time. Counted with a ``TorchDispatchMode`` (machine-independent), for an inner layer (its
input requires grad) in records mode (``I, G``): a convolution adds only the detach of its
recorded input, a Linear nothing (the recorded input's detach replaces a view of the
plain backward); the norm layers add what their per-sample sums need (BatchNorm and
GroupNorm: their input-gradient kernel apart from the per-sample kernel, two statistics
made dense, ``x̂``, two sums). The bounds are the counts reached; they guard against
per-call ops creeping back (placeholders, ``unsqueeze``, ``new_ones``, ``detach`` of a
gradient, ``x[0, 0]``).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx import get_info

from .test_capture_off_plain import OpLog

# capture-on ops minus the plain layer's, per forward + backward
EXTRA_OPS = {"conv": 1, "linear": 0, "batchnorm": 16, "layernorm": 15, "groupnorm": 17}


def _layer(kind: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    img, vec = torch.randn(3, 4, 2, 2), torch.randn(3, 4)
    return {"conv": (nn.Conv2d(4, 4, 1), img), "linear": (nn.Linear(4, 4), vec),
            "batchnorm": (nn.BatchNorm2d(4), img), "layernorm": (nn.LayerNorm(4), vec),
            "groupnorm": (nn.GroupNorm(2, 4), img)}[kind]


def _ops(net: nn.Module, x: torch.Tensor) -> list[str]:
    net(x).sum().backward()  # warm-up (lazy initialisations)
    with OpLog() as log:
        net(x).sum().backward()
    return log.ops


@pytest.mark.parametrize("kind", list(EXTRA_OPS))
def test_captured_call_adds_few_aten_ops(kind: str) -> None:
    layer, x = _layer(kind)
    x.requires_grad_()
    plain = nn.Sequential(layer)
    pm = tengrad_fx.prepare(copy.deepcopy(plain), example_inputs=(x[:2],))
    ref, got = _ops(plain, x), _ops(pm, x)
    assert get_info(pm).store.records  # it did record
    assert len(got) - len(ref) <= EXTRA_OPS[kind], (len(got) - len(ref), sorted(got))
    with tengrad_fx.capturing(pm, False):
        assert _ops(pm, x) == ref  # capture off: the plain layer's ops
