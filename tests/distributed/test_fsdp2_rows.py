"""The row cuts of :mod:`tengrad_fx.distributed.fsdp_rows` against per-sample gradients from
``torch.func`` (float64, one process): for each kind a rank's partial ``J_r g_r`` is
``Σ_{rows a:b} ⟨∂ℓ_i/∂θ[a:b], g_r⟩`` and its rows of ``Jᵀc`` are ``Σ_i c_i ∂ℓ_i/∂θ[a:b]``;
kinds whose rows cannot be cut are refused by name. A transposed Linear (``Conv1D``)'s weight
rows are input features and its bias's rows, sharded apart, output features."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

import tengrad_fx
from tengrad_fx.curvature.layer import CoveredLayer, covered_layers
from tengrad_fx.distributed.fsdp_rows import check_shardable, row_chunk, row_records

M = 5


def _layer(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "linear":
        return nn.Linear(5, 7), torch.randn(M, 3, 5, generator=g)
    if name == "linear-wide":  # one position, wide: the factored Gram
        return nn.Linear(40, 30), torch.randn(M, 40, generator=g)
    if name == "conv1d":  # Hugging Face's transposed Linear: weight [d_in, d_out] = [5, 7]
        from transformers.pytorch_utils import Conv1D
        return Conv1D(7, 5), torch.randn(M, 3, 5, generator=g)
    if name == "conv":
        return nn.Conv2d(3, 6, 3, padding=1), torch.randn(M, 3, 4, 4, generator=g)
    if name == "conv-grouped":  # 2 groups of 3 output channels, 2 input channels each
        return nn.Conv2d(4, 6, 3, padding=1, groups=2), torch.randn(M, 4, 4, 4, generator=g)
    if name == "layernorm":
        return nn.LayerNorm((4, 3)), torch.randn(M, 2, 4, 3, generator=g)
    if name == "batchnorm":
        bn = nn.BatchNorm2d(6)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        return bn, torch.randn(M, 6, 3, 3, generator=g)
    return nn.Embedding(9, 4, padding_idx=2), torch.randint(0, 9, (M, 6), generator=g)


def _captured(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, CoveredLayer]:
    """Layer ``name`` (float64; BatchNorm in eval mode) prepared alone, after one backward of
    ``Σ out·R / M``: (module, input, R, its covered layer)."""
    mod, x = _layer(name)
    mod = mod.double()
    x = x if name == "embedding" else x.double()
    net = tengrad_fx.prepare(nn.Sequential(mod))
    if name == "batchnorm":
        net.eval()
    out = net(x)
    R = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ((out * R).sum() / M).backward()
    return mod, x, R, covered_layers(net)[0]


@pytest.mark.parametrize("name, rows", [(name, rows) for name in ("linear", "conv1d", "conv", "layernorm", "batchnorm",
                                                                 "embedding") for rows in ((0, 2), (1, 4), (3, 3))]
                         + [("conv-grouped", rows) for rows in ((0, 3), (3, 6), (0, 6), (3, 3))])
def test_row_products_equal_per_sample_gradients(name: str, rows: tuple[int, int]) -> None:
    mod, x, R, lay = _captured(name)
    a, b = rows
    ba, bb = (a + 1, b + 3) if name == "conv1d" else rows  # Conv1D: other rows of its bias (of 7)
    cut = row_records(lay, rows, (ba, bb) if name == "conv1d" else None)

    params = {n: p.detach() for n, p in mod.named_parameters()}
    one: Callable[..., torch.Tensor] = lambda ps, xi, ri: (functional_call(mod, ps, (xi[None],)) * ri[None]).sum()
    per_sample = vmap(grad(one), in_dims=(None, 0, 0))(params, x, R)  # {name: [M, *shape]}
    gen = torch.Generator().manual_seed(3)
    gw = torch.randn(b - a, *mod.weight.shape[1:], dtype=torch.float64, generator=gen)
    gb = torch.randn(bb - ba, *mod.bias.shape[1:], dtype=torch.float64, generator=gen) if lay.bias is not None \
        else None
    want = (per_sample["weight"][:, a:b] * gw).flatten(1).sum(1)
    if gb is not None:
        want = want + (per_sample["bias"][:, ba:bb] * gb).flatten(1).sum(1)
    torch.testing.assert_close(cut.jvp(gw, gb), want, rtol=1e-12, atol=1e-12)

    c = torch.randn(M, dtype=torch.float64, generator=gen)
    uw, ub = cut.vjp(c)
    torch.testing.assert_close(uw, torch.einsum("i,i...->...", c, per_sample["weight"][:, a:b]), rtol=1e-12,
                               atol=1e-12)
    if gb is not None:
        assert ub is not None
        torch.testing.assert_close(ub, torch.einsum("i,i...->...", c, per_sample["bias"][:, ba:bb]), rtol=1e-12,
                                   atol=1e-12)


def test_layers_without_row_cuts_are_refused() -> None:
    net = tengrad_fx.prepare(nn.Sequential(nn.ConvTranspose2d(3, 4, 3)))
    with pytest.raises(ValueError, match="layer '0' is a transposed convolution"):
        check_shardable(covered_layers(net)[0])


def test_rows_that_split_a_group_are_refused() -> None:
    """A grouped convolution's rows must be whole groups (each group's per-sample gradients
    need its input channels): rows ``[1, 4)`` of 2 groups of 3 output channels are refused."""
    _, _, _, lay = _captured("conv-grouped")
    with pytest.raises(ValueError, match=r"layer '0' is a convolution of 2 groups .* \[1, 4\) split a group"):
        row_records(lay, (1, 4))


@pytest.mark.parametrize("name", ["linear", "linear-wide", "conv1d", "conv", "layernorm", "batchnorm", "embedding"])
def test_row_grams_sum_to_the_layer_gram(name: str) -> None:
    """``Σ_r J_r J_rᵀ`` over a split of the rows into shards is ``J Jᵀ`` (the layer's own Gram;
    Conv1D: its bias split into shards of its own)."""
    mod, _, _, lay = _captured(name)
    n = mod.weight.shape[0]
    bias_rows = (lambda c: row_chunk(mod.bias.shape[0], 3, c)) if name == "conv1d" else (lambda c: None)
    K = sum(row_records(lay, row_chunk(n, 3, c), bias_rows(c)).gram() for c in range(3))
    J = lay.jacobian()
    torch.testing.assert_close(K, J @ J.T, rtol=1e-12, atol=1e-12)
