"""A small U-Net (conv, strided conv, transposed conv, skip concat) under TENGraD: the first
step equals the dense solve ``(F + αI)⁻¹ g`` per layer with ``J`` from torch.func, and a few
training steps equal dense block NGD's, for every Gram strategy (float64)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.baselines.kfac import KFAC
from tengrad_fx.optim.baselines.ngd import NGD
from testing import explicit_jacobian, per_sample_grads_reference

ALPHA = 0.05


class UNet(nn.Module):
    """[B, 2, 8, 8] -> per-pixel logits [B, 3, 8, 8]."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv2d(2, 4, 3, padding=1)
        self.down = nn.Conv2d(4, 6, 3, stride=2, padding=1)             # -> 4x4
        self.mid = nn.Conv2d(6, 6, 3, padding=1, groups=2, bias=False)
        self.up = nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1)  # -> 8x8 (output_size)
        self.up_same = nn.ConvTranspose2d(8, 4, 2, dilation=2, padding=1, groups=2)  # keeps 8x8
        self.head = nn.Conv2d(4, 3, 1)

    def forward(self, x):
        e = torch.tanh(self.enc(x))
        d = torch.tanh(self.mid(torch.tanh(self.down(e))))
        u = torch.tanh(self.up(d, output_size=e.shape[2:]))
        h = torch.tanh(self.up_same(torch.cat([u, e], 1)))  # skip connection
        return self.head(h)


def _data(m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 2, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (m, 8, 8), generator=g))


def _model(x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    net = UNet().double()
    return copy.deepcopy(net), tengrad_fx.prepare(net, example_inputs=(x[:2],))


def test_unet_is_fully_covered() -> None:
    x, _ = _data(4)
    _, model = _model(x)
    info = tengrad_fx.get_info(model)
    assert info.fallback == {}
    kinds = {layer.name: layer.kind for layer in tengrad_fx.covered_layers(model)}
    assert kinds == {"enc": "conv2d", "down": "conv2d", "mid": "conv2d", "up": "conv_transpose2d",
                     "up_same": "conv_transpose2d", "head": "conv2d"}


@pytest.mark.parametrize("strategy", ["factor", "materialize"])
def test_first_step_is_dense_natural_gradient(strategy: str) -> None:
    x, y = _data(6, seed=1)
    template, model = _model(x)
    opt = TENGraD(model, lr=1.0, damping=ALPHA, momentum=0.0, strategy=strategy, curvature_every=1, kl_clip=None)
    F.cross_entropy(model(x), y).backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    psg = per_sample_grads_reference(template, x, F.cross_entropy, y)
    for layer in tengrad_fx.covered_layers(model):
        names = [f"{layer.name}.weight"] + ([f"{layer.name}.bias"] if layer.bias is not None else [])
        J = explicit_jacobian(psg, names[0], names[1] if len(names) > 1 else None)
        m, n = J.shape
        gv = torch.cat([g[k].flatten() for k in names])
        want = torch.linalg.solve(J.T @ J / m + ALPHA * torch.eye(n, dtype=J.dtype), gv)
        got = torch.cat([(before[k] - p).flatten() for k, p in model.named_parameters() if k in names])
        assert ((got - want).norm() / want.norm()).item() < 1e-9, (layer.name, strategy)


@pytest.mark.parametrize("strategy", ["auto", "factor", "materialize"])
def test_training_steps_equal_block_ngd(strategy: str) -> None:
    x, y = _data(5, seed=2)
    params, losses = [], []
    for cls in (NGD, TENGraD):
        _, model = _model(x)
        kw = dict(strategy=strategy) if cls is TENGraD else {}
        opt = cls(model, lr=0.3, damping=ALPHA, momentum=0.9, weight_decay=1e-3, curvature_every=1, kl_clip=None, **kw)
        run = []
        for step in range(4):
            xb, yb = _data(5, seed=10 + step)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            with torch.no_grad():
                run.append(F.cross_entropy(model(x), y).item())
        if cls is TENGraD and strategy == "materialize":
            assert any(layer.materialized for layer in tengrad_fx.covered_layers(model))
        assert opt.counters["skipped"] == 0
        params.append({k: p.detach().clone() for k, p in model.named_parameters()})
        losses.append(run)
    for k in params[0]:
        torch.testing.assert_close(params[1][k], params[0][k], rtol=1e-8, atol=1e-10)


def test_unet_trains_and_kfac_leaves_transposed_to_sgd() -> None:
    x, _ = _data(8, seed=3)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # a learnable per-pixel labelling
    _, model = _model(x)
    opt = TENGraD(model, lr=0.3, damping=0.1)
    with torch.no_grad():
        start = F.cross_entropy(model(x), y).item()
    for _ in range(8):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert F.cross_entropy(model(x), y).item() < 0.7 * start
    assert opt.counters["skipped"] == 0
    _, model = _model(x)
    with pytest.warns(RuntimeWarning, match=r"transposed convolutions \['up', 'up_same'\]"):
        kfac = KFAC(model, lr=0.1, damping=0.1)
    assert {b.layer.name for b in kfac.blocks} == {"enc", "down", "mid", "head"}
    F.cross_entropy(model(x), y).backward()
    kfac.step()
    assert kfac.counters["skipped"] == 0


def test_compiled_model_and_fused_update_match_eager() -> None:
    """torch.compile of the prepared U-Net (the output_size call included) and the fused
    compiled update over its materialized J give the eager run's parameters."""
    x, _ = _data(6, seed=4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    runs = []
    for mode in ("eager", "compiled-model", "fused-update"):
        _, model = _model(x)
        fwd = torch.compile(model, backend="aot_eager") if mode == "compiled-model" else model
        opt = TENGraD(model, lr=0.3, damping=0.1, strategy="materialize",
                      compile="aot_eager" if mode == "fused-update" else False)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(fwd(x), y).backward()
            opt.step()
        assert all(layer.materialized for layer in tengrad_fx.covered_layers(model))
        assert opt.counters["skipped"] == 0
        runs.append({k: p.detach().clone() for k, p in model.named_parameters()})
    for run in runs[1:]:
        for k in run:
            torch.testing.assert_close(run[k], runs[0][k], rtol=1e-10, atol=1e-12)
