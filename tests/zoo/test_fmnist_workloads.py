"""The Fashion-MNIST workloads beside 3C1F: ``build_model("resnet18" | "mixer")`` shapes and
full coverage, and a narrow MLP-Mixer exact against ``torch.func`` (float64): per-sample
gradients, Grams, ``Jv``, ``Jᵀc`` of every layer and one TENGraD step equal to dense block NGD."""
from __future__ import annotations

import copy

import pytest
import torch

import tengrad_fx
from tengrad_fx.optim.tengrad import TENGraD
from tengrad_fx.zoo.bench_models import FMNIST_MODELS, build_model
from tengrad_fx.zoo.models import MLPMixer
from testing.oracle import check_covered_layers, check_tengrad_step


@pytest.mark.parametrize("name", FMNIST_MODELS)
def test_builds_and_is_fully_covered(name: str) -> None:
    torch.manual_seed(0)
    model, shape = build_model(name)
    assert shape == (1, 28, 28)
    x = torch.randn(3, *shape)
    assert model(x).shape == (3, 10)
    prepared = tengrad_fx.prepare(model, example_inputs=(x,))
    covered = {id(p) for lay in tengrad_fx.covered_layers(prepared) for p in (lay.weight, lay.bias) if p is not None}
    missing = [n for n, p in prepared.named_parameters() if id(p) not in covered]
    assert not missing, (name, missing)


def _mixer() -> MLPMixer:
    """Narrow, float64; the token MLPs' output biases frozen: each adds one constant to all
    channels of a token, which every later LayerNorm (over channels) removes, so their
    gradient is zero up to rounding and a relative error on it would compare noise."""
    torch.manual_seed(1)
    model = MLPMixer(image=8, patch=4, width=6, depth=2, token_hidden=3, channel_hidden=5).double()
    for block in model.blocks:
        block.token_mlp[2].bias.requires_grad_(False)
    return model


def _mixer_case(seed: int, m: int) -> tuple[MLPMixer, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(original, prepared copy, x [m, 1, 8, 8], labels [m]) from fresh random inputs."""
    orig = _mixer()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 1, 8, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (m,), generator=g)
    return orig, tengrad_fx.prepare(copy.deepcopy(orig), example_inputs=(x[:2],)), x, y


def test_mixer_layers_exact_against_torch_func() -> None:
    orig, prepared, x, y = _mixer_case(2, 5)
    check_covered_layers(orig, prepared, x, y)


def test_mixer_step_equals_dense_block_ngd() -> None:
    orig, prepared, x, y = _mixer_case(3, 6)
    opt = TENGraD(prepared, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(prepared, opt, orig, x, y, 0.05)
