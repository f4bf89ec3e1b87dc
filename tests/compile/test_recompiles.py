"""Compiles once per model and step kind: neither the capture switch nor another prepared
model in the same process recompiles a model's forward or an optimizer's fused update."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import tengrad_fx


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def test_twelve_models_and_a_capture_switch_compile_twice_each() -> None:
    """Capture on, off, on: two frames per model (capturing, plain), none recompiled
    later; dynamo's cache limit (8 per code object) would stop this before model 5."""
    torch._dynamo.reset()
    counter = CompileCounter()
    x = torch.randn(8, 6)
    for i in range(12):
        pm = tengrad_fx.prepare(_model(i), example_inputs=(x[:2],))
        fwd = torch.compile(pm, backend=counter)
        store = tengrad_fx.get_info(pm).store
        for on in (True, False, True, False, True):
            before = store.generation
            with tengrad_fx.capturing(pm, on):
                fwd(x).sum().backward()
            assert store.generation == before + on  # a capturing step records, a plain one does not
        assert counter.frame_count == 2 * (i + 1), f"model {i}: {counter.frame_count} compiles"


def test_fused_update_compiles_once_per_optimizer() -> None:
    """``TENGraD(compile=...)``: each optimizer's fused update compiles once for its shapes,
    another optimizer with other shapes does not evict or recompile it."""
    torch._dynamo.reset()
    counter = CompileCounter()
    for i in range(10):
        torch.manual_seed(i)
        d = 4 + i  # other shapes for every model
        pm = tengrad_fx.prepare(nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, 3)),
                                example_inputs=(torch.randn(2, d),))
        opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, kl_clip=None, compile=counter)
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(pm(torch.randn(8, d)), torch.randint(0, 3, (8,))).backward()
            opt.step()
        assert counter.frame_count == i + 1, f"optimizer {i}: {counter.frame_count} compiles"
