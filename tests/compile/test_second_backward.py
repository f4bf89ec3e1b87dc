"""The MC Fisher's extra backward through a compiled model: never through a backward that
donated its saved tensors, even one loaded from inductor's on-disk cache, compiled there
with donation on (its key does not say so)."""
from __future__ import annotations

from typing import Iterator

import pytest
import torch

import torch.nn.functional as F
from torch._functorch import config as functorch_config

import tengrad_fx

from testing.tiny_data import tiny_cnn


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_cnn("cnn", None)  # a ReLU output among the saved tensors: donated


def _batch(m: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, 1, 28, 28, generator=g), torch.randint(0, 10, (m,), generator=g)


def _mc_grads(compiled: bool, m: int = 16) -> list[torch.Tensor]:
    x, y = _batch(m)
    pm = tengrad_fx.prepare(_model(), example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, fisher="mc")
    out = (torch.compile(pm) if compiled else pm)(x)
    torch.manual_seed(1)
    opt.mc_capture(out)  # a backward with retain_graph=True
    F.cross_entropy(out, y).backward()
    return [p.grad.clone() for p in pm.parameters()]


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One thread: inductor's CPU graph of this model then donates a ReLU output."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_mc_backward_after_a_cached_donating_compile(one_thread: None) -> None:
    x, y = _batch()
    pm = tengrad_fx.prepare(_model(), example_inputs=(x[:2],))
    torch._dynamo.reset()
    with functorch_config.patch(donated_buffer=True), torch.compiler.config.patch(cache_key_tag=""):
        F.cross_entropy(torch.compile(pm)(x), y).backward()  # the same graph, donating, into the disk cache
    torch._dynamo.reset()
    got, want = _mc_grads(True), _mc_grads(False)
    for a, b in zip(got, want):
        assert ((a - b).norm() / b.norm()).item() <= 1e-5


def test_model_compiled_before_the_optimizer_never_silently_wrong(one_thread: None) -> None:
    """Donation turned back on by the user after prepare(): the MC pass is refused with a
    clear error where the backward donates saved tensors, and otherwise gives eager's
    gradients."""
    torch._dynamo.reset()
    x, y = _batch(12)
    pm = tengrad_fx.prepare(_model(), example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, fisher="mc")
    torch.manual_seed(1)
    with functorch_config.patch(donated_buffer=True):  # turned back on after prepare()
        out = torch.compile(pm)(x)
        try:
            opt.mc_capture(out)
        except RuntimeError as exc:
            assert "backpropagates twice" in str(exc)
            return
    F.cross_entropy(out, y).backward()
    want = _mc_grads(False, 12)
    for p, b in zip(pm.parameters(), want):
        assert ((p.grad - b).norm() / b.norm()).item() <= 1e-5
