"""Parameters covered by replaying their module per sample (:mod:`tengrad_fx.capture.replay`):
a scan's decay and skip weights, a convolution weight passed to ``F.conv1d`` without calling its
module, a gated norm, all exact against ``torch.func`` in float64 (per-sample gradients, Grams,
``Jv``, ``Jᵀc``, one TENGraD step against dense block NGD); a module that mixes samples falls
back with the reason; a constant input that has the batch's size is not sliced per sample."""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tengrad_fx import TENGraD, get_info, prepare, unprepare
from testing.oracle import check_covered_layers, dense_layer_updates
from testing.tengrad_step import assert_matches, step_delta

D, T, C = 4, 3, 3


class Scan(nn.Module):
    """``h_t = a ⊙ h_{t-1} + u_t`` on ``u = conv(x)`` (its conv weight read functionally), out
    ``h + D ⊙ x``; ``x [m, T, D]``. The loop over time does not trace with ``torch.fx``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.rand(D) * 0.5 + 0.2)
        self.skip = nn.Parameter(torch.randn(D))
        self.conv = nn.Conv1d(D, D, 2, groups=D, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        u = F.conv1d(x.transpose(1, 2), self.conv.weight, self.conv.bias, padding=1, groups=D)
        u = u[..., : x.shape[1]].transpose(1, 2)
        h, hs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = self.a * h + u[:, t]
            hs.append(h)
        return torch.stack(hs, 1) + self.skip * x


class GatedNorm(nn.Module):
    """``x̂ ⊙ γ ⊙ silu(gate)``; with ``check``, a test of the gate's values (data-dependent
    control flow: no ``vmap``; the reference copy runs without it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(D))
        self.eps = 1e-6
        self.check = True

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        if self.check and bool((gate.abs() > 1e6).any()):
            gate = gate.clamp(-1e6, 1e6)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight * F.silu(gate)


class Table(nn.Module):
    """``x + table[:T]``, with ``table [rows, D]`` handed in by the caller (a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor, table: Tensor) -> Tensor:
        return x + self.scale * table[: x.shape[1]].sum(0)


class Net(nn.Module):
    def __init__(self, mix: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(D, 2 * D)
        self.scan = Scan()
        self.norm = GatedNorm()
        self.table = Table()
        self.register_buffer("rows", torch.randn(2, D))  # 2 rows: the example batch's size
        self.mix = Mix() if mix else None
        self.head = nn.Linear(D, C)

    def forward(self, x: Tensor) -> Tensor:
        u, gate = self.inp(x).chunk(2, -1)
        h = self.norm(self.scan(u), gate)
        h = self.table(h, self.rows)
        if self.mix is not None:
            h = self.mix(h)
        return self.head(h.mean(1))


class Mix(nn.Module):
    """Subtracts the batch mean, scaled: mixes samples."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D))

    def forward(self, x: Tensor) -> Tensor:
        return x - self.w * x.mean(0, keepdim=True)


def _net(mix: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Net(mix).double()


def _reference(net: nn.Module) -> nn.Module:
    """``net``'s copy for ``vmap(grad)`` (the same function, without the data-dependent test)."""
    ref = copy.deepcopy(net)
    ref.norm.check = False
    return ref


def _batch(m: int = 4) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(m, T, D, generator=gen, dtype=torch.float64), torch.randint(0, C, (m,), generator=gen)


REPLAYED = ["scan.a", "scan.skip", "scan.conv.weight", "scan.conv.bias", "norm.weight", "table.scale"]


def test_replayed_parameters_are_covered_and_exact() -> None:
    net = _net()
    orig = _reference(net)
    x, y = _batch()
    model = prepare(net, example_inputs=(x[:2],))
    info = get_info(model)
    assert info.method == "surgery"
    assert not info.fallback, info.fallback
    assert all(n in info.covered for n in REPLAYED)
    replays = {n: mod.__dict__["_tengrad_replay"] for n, mod in model.named_modules()
               if "_tengrad_replay" in mod.__dict__}
    assert sorted(replays) == ["norm", "scan", "table"]  # the uncalled conv: replayed by its parent
    assert replays["scan"].names == ["a", "skip", "conv.weight", "conv.bias"]
    assert replays["norm"].use_vmap is False and replays["scan"].use_vmap is True
    assert replays["table"].positions is not None and 1 not in replays["table"].positions  # rows: a constant
    check_covered_layers(orig, model, x[:2], y[:2], tol=1e-10)  # at batch 2: `rows` has the batch's size


def _assert_step_is_dense_block_ngd(backward: Callable[[nn.Module, Tensor, Tensor], None]) -> None:
    """``backward(model, x, y)`` on a batch of 5, then one TENGraD step (lr 1, no momentum):
    each replayed parameter moves by dense block NGD's ``(F + αI)⁻¹ g`` of the whole batch."""
    net = _net()
    orig = _reference(net)
    x, y = _batch(5)
    model = prepare(net, example_inputs=(x[:2],))
    damping = 0.1
    opt = TENGraD(model, lr=1.0, damping=damping, momentum=0.0, curvature_every=1, kl_clip=None)
    backward(model, x, y)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    delta = step_delta(model, opt)
    want = dense_layer_updates(orig, x, y, F.cross_entropy, grads, damping, get_info(model).covered)
    assert_matches({n: delta[n] for n in REPLAYED}, {n: want[n] for n in REPLAYED}, tol=1e-9)


def test_replayed_tengrad_step_is_dense_block_ngd() -> None:
    _assert_step_is_dense_block_ngd(lambda model, x, y: F.cross_entropy(model(x), y).backward())


def test_module_that_mixes_samples_falls_back_with_reason() -> None:
    x, _ = _batch()
    model = prepare(_net(mix=True), example_inputs=(x[:2],))
    info = get_info(model)
    assert "mix.w" not in info.covered
    assert "replaying Mix 'mix' per sample is not exact" in info.fallback["mix.w"], info.fallback["mix.w"]
    assert all(n in info.covered for n in REPLAYED)


@pytest.mark.parametrize("fisher", ["mc", "empirical"])
def test_replay_records_the_fisher_backward_only(fisher: str) -> None:
    x, y = _batch()
    model = prepare(_net(), example_inputs=(x[:2],))
    opt = TENGraD(model, lr=0.1, damping=0.1, fisher=fisher, curvature_every=1)
    store = get_info(model).store
    site = next(s.sites[0] for s in get_info(model).layers if s.name == "scan.a")
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        assert len(store.records[site]) == 1  # the MC backward's records, not also the training backward's
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_unprepare_restores_replayed_modules() -> None:
    x, _ = _batch()
    model = prepare(_net(), example_inputs=(x[:2],))
    net = unprepare(model)
    assert type(net.scan) is Scan and type(net.norm) is GatedNorm and type(net.table) is Table
    assert not any("_tengrad_replay" in mod.__dict__ for mod in net.modules())


def test_replayed_rows_accumulate_over_micro_batches() -> None:
    """Two micro-batches (2 and 3 samples), each loss weighed by its share: one step equals
    dense block NGD on the whole batch for the replayed parameters."""
    def two_micro_batches(model: nn.Module, x: Tensor, y: Tensor) -> None:
        for sl in (slice(0, 2), slice(2, 5)):
            (F.cross_entropy(model(x[sl]), y[sl]) * (sl.stop - sl.start) / 5).backward()

    _assert_step_is_dense_block_ngd(two_micro_batches)
