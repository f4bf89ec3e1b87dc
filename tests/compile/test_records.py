"""torch.compile never changes what a prepared model records: every backend, mode and
shape setting, every activation and in-place op around covered layers, every capture
kind, against the eager records (float64 to 1e-12, float32 to rounding) and torch.func."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tengrad_fx

from ._check import (assert_per_sample, assert_same, compiled_records, eager_records, prepare)

TOL64 = 1e-12


def test_relu_between_linears_records_its_output() -> None:
    """The smallest failing case: ``Linear -> ReLU -> Linear`` under inductor."""
    torch.manual_seed(0)
    x = torch.randn(8, 6, dtype=torch.float64)
    snaps = []
    for compiled in (False, True):
        torch.manual_seed(0)
        pm = tengrad_fx.prepare(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double(),
                                example_inputs=(x[:2],))
        (torch.compile(pm) if compiled else pm)(x).pow(2).sum().backward()
        store = tengrad_fx.get_info(pm).store
        snaps.append([(r.I.clone(), r.G.clone()) for s in sorted(store.records) for r in store.records[s]])
    for (I0, G0), (I1, G1) in zip(*snaps):
        assert (I0 - I1).abs().max() <= TOL64 * I0.abs().max() and (G0 - G1).abs().max() <= TOL64 * G0.abs().max()


CONFIGS = {
    "inductor": {},
    "inductor-fullgraph": {"fullgraph": True},
    "inductor-dynamic": {"dynamic": True},
    "max-autotune-no-cudagraphs": {"mode": "max-autotune-no-cudagraphs"},
    "aot_eager": {"backend": "aot_eager"},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_activations(config: str) -> None:
    """Every activation / in-place op around Linear layers (eval mode: dropout off)."""
    got, = compiled_records("activations", (8,), train=False, **CONFIGS[config])
    assert_same(got, eager_records("activations", 8, train=False), TOL64)


def test_activations_second_batch_size() -> None:
    """A second batch size after the first compile (dynamo recompiles, dynamic shapes)."""
    got = compiled_records("activations", (8, 5, 7), train=False)
    for i, (snap, m) in enumerate(zip(got, (8, 5, 7))):
        assert_same(snap, eager_records("activations", m, seed=i, train=False), TOL64)


def test_activations_float32() -> None:
    got, = compiled_records("activations", (8,), dtype=torch.float32, train=False)
    assert_same(got, eager_records("activations", 8, dtype=torch.float32, train=False), 1e-5)


@pytest.mark.parametrize("name", ["convs", "tokens"])
@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("jacobian", [False, True], ids=["IG", "P"])
def test_capture_kinds(name: str, backend: str, jacobian: bool) -> None:
    """Conv1d/2d/3d, grouped, depthwise, transposed, BatchNorm, GroupNorm (convs);
    Embedding, LayerNorm, attention, RMSNorm, a folded Linear (tokens); with I, G
    recorded or P materialized in the backward."""
    got, = compiled_records(name, (6,), jacobian=jacobian, backend=backend)
    assert_same(got, eager_records(name, 6, jacobian=jacobian), TOL64)


@pytest.mark.parametrize("name", ["activations", "convs", "tokens"])
def test_per_sample_gradients_equal_torch_func(name: str) -> None:
    """The compiled model's per-sample gradients equal vmap(grad) of the original one
    (eval mode: with batch statistics the samples are coupled)."""
    orig, pm = prepare(name, train=False)
    assert_per_sample(orig, pm, name, 6, seed=3, tol=1e-10, fwd=torch.compile(pm))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the CPU twins above run everywhere)")


@cuda
@pytest.mark.parametrize("name", ["activations", "convs", "tokens"])
@pytest.mark.parametrize("jacobian", [False, True], ids=["IG", "P"])
def test_cuda_records_equal_eager(name: str, jacobian: bool) -> None:
    """Inductor's CUDA code (Triton) differs from its CPU code: the same matrix on a GPU,
    against the CPU eager records (float64)."""
    train = name != "activations"
    got, = compiled_records(name, (6,), train=train, jacobian=jacobian, device="cuda")
    assert_same(got, eager_records(name, 6, train=train, jacobian=jacobian), 1e-10)


@cuda
def test_cuda_activations_float32_and_dynamic() -> None:
    got = compiled_records("activations", (8, 5), dtype=torch.float32, train=False, device="cuda", dynamic=True)
    for i, (snap, m) in enumerate(zip(got, (8, 5))):
        assert_same(snap, eager_records("activations", m, seed=i, dtype=torch.float32, train=False), 1e-4)
