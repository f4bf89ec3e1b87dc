"""The row cuts of :mod:`tengrad_fx.distributed.fsdp_rows` against per-sample gradients from
``torch.func`` (float64, one process): for each kind a rank's partial ``J_r g_r`` is
``Σ_{rows a:b} ⟨∂ℓ_i/∂θ[a:b], g_r⟩``, its rows of ``Jᵀc`` are ``Σ_i c_i ∂ℓ_i/∂θ[a:b]`` and its
Gram contribution ``J_r J_rᵀ`` is that of those per-sample gradients; kinds whose rows cannot
be cut are refused by name. A transposed layer's (``Conv1D``, ``ConvTransposeNd``) weight rows
are input features or channels and its bias's rows, sharded apart, output ones."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from torch.func import functional_call, grad, vmap

import tengrad_fx
from tengrad_fx.curvature.layer import CoveredLayer, covered_layers
from tengrad_fx.distributed.fsdp_rows import check_shardable, row_chunk, row_records

M = 5
# transposed: bias rows of their own
BIAS_APART = ("conv1d", "tconv", "tconv-grouped", "tconv-grouped3", "tconv1d", "tconv3d-grouped")


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
    if name == "conv-grouped3":  # 3 groups of 2 output channels, 1 input channel each
        return nn.Conv2d(3, 6, 3, padding=1, groups=3), torch.randn(M, 3, 4, 4, generator=g)
    if name == "tconv":  # weight [5, 7, 3, 3]: rows are input channels; output_padding
        return nn.ConvTranspose2d(5, 7, 3, stride=2, padding=1, output_padding=1), torch.randn(M, 5, 3, 3, generator=g)
    if name == "tconv-grouped":  # weight [4, 3, 3, 3]: 2 groups of 2 input and 3 output channels
        return nn.ConvTranspose2d(4, 6, 3, padding=1, groups=2), torch.randn(M, 4, 3, 3, generator=g)
    if name == "tconv-grouped3":  # weight [6, 1, 3, 3]: 3 groups of 2 input channels and 1 output channel
        return nn.ConvTranspose2d(6, 3, 3, stride=2, padding=1, output_padding=1, groups=3), \
            torch.randn(M, 6, 3, 3, generator=g)
    if name == "tconv1d":
        return nn.ConvTranspose1d(4, 3, 3, stride=2, dilation=2), torch.randn(M, 4, 5, generator=g)
    if name == "tconv3d-grouped":  # weight [4, 1, 2, 2, 2]: 2 groups of 2 input channels, 1 output
        return nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2), torch.randn(M, 4, 2, 2, 2, generator=g)
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


def _bias_rows(name: str, rows: tuple[int, int]) -> tuple[int, int]:
    """The bias rows tested with weight rows ``rows``: the same rows, or for a transposed layer
    other ones (its bias's output features or channels, sharded apart)."""
    a, b = rows
    return {"conv1d": (a + 1, b + 3), "tconv": (a + 2, b + 3), "tconv-grouped": (b - a, 6), "tconv1d": (1, 3),
            "tconv3d-grouped": (a // 2, 2), "tconv-grouped3": (a // 3, a // 3 + 2)}.get(name, rows)


CASES = [(name, rows) for name in ("linear", "conv1d", "conv", "tconv", "tconv1d", "layernorm", "batchnorm",
                                   "embedding") for rows in ((0, 2), (1, 4), (3, 3))] \
    + [("conv-grouped", rows) for rows in ((0, 3), (3, 6), (0, 6), (3, 3), (1, 4), (2, 3), (1, 6))] \
    + [(name, rows) for name in ("tconv-grouped", "tconv3d-grouped")
       for rows in ((0, 2), (2, 4), (0, 4), (2, 2), (1, 3), (1, 2), (0, 3))] \
    + [(name, rows) for name in ("conv-grouped3", "tconv-grouped3") for rows in ((0, 3), (3, 6), (1, 5))]


def _per_sample(mod: nn.Module, x: torch.Tensor, R: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: [M, *shape]}``: per-sample gradients of ``Σ out·R`` by ``vmap(grad)``."""
    params = {n: p.detach() for n, p in mod.named_parameters()}
    one: Callable[..., torch.Tensor] = lambda ps, xi, ri: (functional_call(mod, ps, (xi[None],)) * ri[None]).sum()
    out: dict[str, torch.Tensor] = vmap(grad(one), in_dims=(None, 0, 0))(params, x, R)
    return out


@pytest.mark.parametrize("name, rows", CASES)
def test_row_products_equal_per_sample_gradients(name: str, rows: tuple[int, int]) -> None:
    mod, x, R, lay = _captured(name)
    a, b = rows
    ba, bb = _bias_rows(name, rows)
    cut = row_records(lay, rows, (ba, bb) if name in BIAS_APART else None)

    per_sample = _per_sample(mod, x, R)
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

    J_r = per_sample["weight"][:, a:b].flatten(1)
    if gb is not None:
        J_r = torch.cat([J_r, per_sample["bias"][:, ba:bb].flatten(1)], 1)
    torch.testing.assert_close(cut.gram(), J_r @ J_r.T, rtol=1e-12, atol=1e-12)


def test_transposed_convolution_reference_detects_a_wrong_cut() -> None:
    """The per-sample reference tells rows apart: a transposed convolution's Gram over rows
    ``[0, 2)`` with the bias's rows ``[2, 5)`` differs from those of the next rows, of the
    output channels in place of the input ones, and of the bias's rows ``[0, 3)``."""
    mod, x, R, lay = _captured("tconv")
    per_sample = _per_sample(mod, x, R)
    K = row_records(lay, (0, 2), (2, 5)).gram()

    def gram(w: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
        J_r = torch.cat([w.flatten(1), db], 1)
        return J_r @ J_r.T

    W, B = per_sample["weight"], per_sample["bias"]
    for wrong in (gram(W[:, 1:3], B[:, 2:5]), gram(W[:, :, 0:2], B[:, 2:5]), gram(W[:, 0:2], B[:, 0:3])):
        assert not torch.allclose(K, wrong, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(K, gram(W[:, 0:2], B[:, 2:5]), rtol=1e-12, atol=1e-12)


def test_layers_without_row_cuts_are_refused() -> None:
    """A kind with no row cut (none of the captured kinds now) is refused by name; every
    transposed convolution is cut."""
    odd = SimpleNamespace(name="odd", kind="experts", spec=None, bias_only=False)
    with pytest.raises(ValueError, match="layer 'odd' is a layer of kind 'experts', whose rows are not cut"):
        check_shardable(odd)  # type: ignore[arg-type]
    net = tengrad_fx.prepare(nn.Sequential(nn.ConvTranspose1d(3, 4, 3), nn.ConvTranspose2d(4, 4, 3, groups=2),
                                           nn.ConvTranspose3d(4, 2, 1)))
    for lay in covered_layers(net):
        check_shardable(lay)


@pytest.mark.parametrize("name", ["conv-grouped3", "tconv-grouped3"])
def test_rows_that_split_a_group_against_wrong_references(name: str) -> None:
    """Rows ``[0, 3)`` of 3 groups of 2 (group 0 and half of group 1): their Gram is that of
    those rows' per-sample gradients, not of the rows one further on, nor of the rows whole
    groups would give (``[0, 2)`` or ``[0, 4)``)."""
    mod, x, R, lay = _captured(name)
    per_sample = _per_sample(mod, x, R)
    W = per_sample["weight"]
    bias_rows = (0, 2) if name in BIAS_APART else (0, 3)  # a transposed one's bias rows: output channels
    K = row_records(lay, (0, 3), bias_rows if name in BIAS_APART else None).gram()
    db = per_sample["bias"][:, bias_rows[0]:bias_rows[1]]

    def gram(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        J_r = torch.cat([w.flatten(1), b], 1)
        return J_r @ J_r.T

    for wrong in (gram(W[:, 1:4], db), gram(W[:, 0:2], db), gram(W[:, 0:4], db)):
        assert not torch.allclose(K, wrong, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(K, gram(W[:, 0:3], db), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["linear", "linear-wide", "conv1d", "conv", "conv-grouped", "conv-grouped3", "tconv",
                                  "tconv-grouped", "tconv-grouped3", "layernorm", "batchnorm", "embedding"])
def test_row_grams_sum_to_the_layer_gram(name: str) -> None:
    """``Σ_r J_r J_rᵀ`` over a split of the rows into shards is ``J Jᵀ`` (the layer's own Gram;
    a transposed layer: its bias split into shards of its own; a grouped convolution's groups
    split by the shards)."""
    mod, _, _, lay = _captured(name)
    n = mod.weight.shape[0]
    S = {"conv-grouped3": 2, "tconv-grouped3": 2, "tconv-grouped": 4}.get(name, 3)  # grouped: shards splitting groups
    bias_rows: Callable[[int], Any] = (lambda c: row_chunk(mod.bias.shape[0], S, c)) if name in BIAS_APART \
        else (lambda c: None)
    K = sum(row_records(lay, row_chunk(n, S, c), bias_rows(c)).gram() for c in range(S))
    J = lay.jacobian()
    torch.testing.assert_close(K, J @ J.T, rtol=1e-12, atol=1e-12)
