"""TENGraD with norm layers preconditioned: the update of every layer (BatchNorm,
LayerNorm, GroupNorm, RMSNorm included) equals ``solve(JᵀJ/m + αI, g)`` with ``J`` from
``torch.func`` on the unprepared model (eval-mode BatchNorm: exact per-sample gradients),
on the materialized-``P`` path and by the positions form; the baselines accept norm layers.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.capture.norm import NORM_KINDS
from testing import check_tengrad_step


class _Tokens(nn.Module):
    """[m, 4, 3] tokens -> LayerNorm'd, RMSNorm'd features -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 6)
        self.ln = nn.LayerNorm(6)
        self.rms = nn.RMSNorm(6)
        self.head = nn.Linear(24, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rms(torch.tanh(self.ln(self.inp(x)))).flatten(1))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 4))


MODELS = {"cnn": (_cnn, (2, 4, 4)), "tokens": (_Tokens, (4, 3))}


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("strategy", ["auto", "factor"])
def test_tengrad_update_with_norm_layers_is_exact(kind: str, strategy: str) -> None:
    torch.manual_seed(0)
    build, shape = MODELS[kind]
    net = build().double().eval()
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for mod in net.modules():
            if getattr(mod, "running_var", None) is not None:
                mod.running_mean.normal_()
                mod.running_var.uniform_(0.5, 1.5)
            if type(mod).__name__ in ("BatchNorm2d", "GroupNorm", "LayerNorm", "RMSNorm"):
                mod.weight.normal_()
    orig = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    m = 6
    x = torch.randn(m, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (m,), generator=g)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    model.eval()
    damping = 0.07
    opt = TENGraD(model, lr=1.0, damping=damping, momentum=0.0, strategy=strategy, curvature_every=1, kl_clip=None)
    norm_sites = {s for spec in tengrad_fx.get_info(model).layers if spec.kind in NORM_KINDS for s in spec.sites}
    if strategy == "auto":  # the cost model materializes norm layers from the first backward
        assert norm_sites <= tengrad_fx.get_info(model).store.jacobian_sites
    info = tengrad_fx.get_info(model)
    assert not info.fallback, info.fallback  # every parameter preconditioned
    assert sum(spec.kind in NORM_KINDS for spec in info.layers) == 2
    check_tengrad_step(model, opt, orig, x, y, damping)


@pytest.mark.parametrize("method", ["kfac", "ekfac", "kbfgs"])
def test_baselines_step_on_norm_layers(method: str) -> None:
    """The baselines treat a norm layer as C groups of a 1-in, 1-out layer: a finite step
    that changes the norm parameters."""
    torch.manual_seed(0)
    model = tengrad_fx.prepare(_cnn(), example_inputs=(torch.randn(2, 2, 4, 4),))
    opt = tengrad_fx.make_optimizer(method, model, lr=0.1, damping=0.1)
    x, y = torch.randn(8, 2, 4, 4), torch.randint(0, 4, (8,))
    before = model.get_parameter("1.weight").detach().clone()
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert torch.isfinite(model.get_parameter("1.weight")).all()
    assert not torch.equal(before, model.get_parameter("1.weight"))


def test_norm_capture_compiles_without_graph_breaks() -> None:
    """``torch.compile(fullgraph=True)`` of a prepared model with norm layers: one graph,
    and the compiled backward still records every layer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                        nn.Conv2d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Flatten(),
                        nn.LayerNorm(64), nn.Linear(64, 4), nn.RMSNorm(4))
    x, y = torch.randn(6, 2, 4, 4), torch.randint(0, 4, (6,))
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    explained = torch._dynamo.explain(model)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    F.cross_entropy(compiled(x), y).backward()
    info = tengrad_fx.get_info(model)
    assert sum(len(v) for v in info.store.records.values()) == len(info.layers) == 7
