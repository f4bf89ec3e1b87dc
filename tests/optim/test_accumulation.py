"""Gradient accumulation: one TENGraD step after ``k`` accumulated backwards, float64.

The curvature of the step is the micro-batches' union: ``M = Σ_j m_j`` rows, ``F = JᵀJ/M``,
``u = (F + αI)⁻¹ g`` with ``g`` the accumulated gradient. The reference ``J`` comes from
``torch.func`` per-sample gradients on an unprepared copy (:mod:`testing.oracle`), micro-batch
by micro-batch:

* each micro-batch's mean loss times ``m_j/M`` (``"share"``; equal micro-batches: ``1/k``):
  the whole batch's mean loss, rows ``∂ℓ_i/∂W``: whole-batch NGD;
* ``1/k`` on unequal micro-batches (``"over_k"``): the accumulated loss read as a mean
  over ``M`` samples, sample ``i`` of micro-batch ``j`` weighs ``M/(k·m_j)``, and so does its row;
* MC Fisher: rows of the sampled labels (drawn per micro-batch from the optimizer's
  seeded generator), unweighted whatever the training loss's scaling.
"""
from __future__ import annotations

import copy
import warnings
from typing import Callable, Sequence

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.step.mc import sample_targets
from testing.oracle import per_sample_grads_reference
from testing.tengrad_step import batch, cnn, layer_params, rel, snapshot, step_delta

Part = tuple[torch.Tensor, torch.Tensor]
Params = list[torch.Tensor]
DAMPING = 0.05
TOL = 1e-10


class _SeqNet(nn.Module):
    """Embedding → Conv1d → GroupNorm → LayerNorm → Linear on token ids ``[m, 5]``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.conv = nn.Conv1d(4, 6, 3, padding=1)
        self.gn = nn.GroupNorm(2, 6)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6 * 5, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.gn(self.conv(self.emb(idx).transpose(1, 2))))  # [m, 6, 5]
        return self.fc(self.ln(h.transpose(1, 2)).flatten(1))


class _PoolNet(nn.Module):
    """Embedding → Linear → LayerNorm → mean over positions → Linear: any sequence length."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.lin = nn.Linear(4, 6)
        self.ln = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.ln(torch.tanh(self.lin(self.emb(idx)))).mean(1))


def _seq_batch(m: int, seed: int, length: int = 5) -> Part:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (m, length), generator=g), torch.randint(0, 3, (m,), generator=g)


def _model(kind: str) -> tuple[nn.Module, nn.Module]:
    """(unprepared template, prepared model), float64."""
    torch.manual_seed(0)
    net = cnn() if kind == "cnn" else (_SeqNet() if kind == "seq" else _PoolNet()).double()
    template = copy.deepcopy(net)
    example = batch("cnn", 2, 99)[0] if kind == "cnn" else _seq_batch(2, 99)[0]
    return template, tengrad_fx.prepare(net, example_inputs=(example,))


def _optimizer(model: nn.Module, **kw) -> tengrad_fx.TENGraD:
    opt_kw = dict(lr=1.0, damping=DAMPING, momentum=0.0, weight_decay=0.0, curvature_every=1, kl_clip=None)
    opt_kw.update(kw)
    return tengrad_fx.TENGraD(model, **opt_kw)


def _parts(kind: str, sizes: Sequence[int]) -> list[Part]:
    make = (lambda m, s: batch("cnn", m, s, classes=4)) if kind == "cnn" else _seq_batch
    return [make(m, 10 + j) for j, m in enumerate(sizes)]


def _factors(parts: list[Part], scaling: str) -> list[float]:
    """Each micro-batch's loss factor: ``m_j/M`` (``"share"``) or ``1/k`` (``"over_k"``)."""
    M = sum(len(y) for _, y in parts)
    return [len(y) / M if scaling == "share" else 1.0 / len(parts) for _, y in parts]


def _accumulate(model: nn.Module, opt: torch.optim.Optimizer, parts: list[Part], scaling: str) -> list[torch.Tensor]:
    """``opt.zero_grad()``, then one forward/backward of ``c_j · mean loss`` per micro-batch;
    returns the outputs (detached)."""
    opt.zero_grad()
    outs = []
    for (x, y), c in zip(parts, _factors(parts, scaling)):
        out = model(x)
        outs.append(out.detach())
        (F.cross_entropy(out, y) * c).backward()
    return outs


def _dense(ref: nn.Module, parts: list[Part], weights: list[float], g: dict[str, torch.Tensor],
           layers: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """``u = solve(JᵀJ/M + αI, g)`` per layer, ``J``'s rows those of micro-batch ``j``'s
    per-sample cross-entropy gradients times ``weights[j]``."""
    psg = [per_sample_grads_reference(ref, x, F.cross_entropy, y) for x, y in parts]
    out = {}
    for names in layers.values():
        J = torch.cat([w * torch.cat([p[n].flatten(1) for n in names], 1) for p, w in zip(psg, weights)])
        M, n = J.shape
        u = torch.linalg.solve(J.T @ J / M + DAMPING * torch.eye(n, dtype=J.dtype),
                               torch.cat([g[k].flatten() for k in names]))
        off = 0
        for k in names:
            out[k] = u[off: off + g[k].numel()].view_as(g[k])
            off += g[k].numel()
    return out


def _check(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], covered: set[str]) -> None:
    assert set(ref) == covered, covered ^ set(ref)
    for k in ref:
        assert rel(delta[k], ref[k]) <= TOL, (k, rel(delta[k], ref[k]))


SIZES = {("equal", 2): [6, 6], ("equal", 4): [3, 3, 3, 3], ("unequal", 2): [5, 7], ("unequal", 4): [2, 4, 3, 3]}


@pytest.mark.parametrize("kind", ["seq", "cnn"])
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("sizes,scaling", [("equal", "over_k"), ("unequal", "share"), ("unequal", "over_k")])
def test_accumulated_step_equals_dense_ngd(kind: str, fisher: str, k: int, sizes: str, scaling: str) -> None:
    template, model = _model(kind)
    opt = _optimizer(model, fisher=fisher)
    opt.seed_mc(3)
    parts = _parts(kind, SIZES[sizes, k])
    ref_model = snapshot(template, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        outs = _accumulate(model, opt, parts, scaling)
        g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        delta = step_delta(model, opt)
    M = sum(len(y) for _, y in parts)
    if scaling == "share" or sizes == "equal":  # the accumulated gradient is the whole batch's mean loss's
        ref_model.zero_grad()
        F.cross_entropy(ref_model(torch.cat([x for x, _ in parts])), torch.cat([y for _, y in parts])).backward()
        for n, p in ref_model.named_parameters():
            assert rel(g[n], p.grad) <= 1e-12, n
    if fisher == "mc":  # the labels each micro-batch's sampled backward drew, rows unweighted
        gen = torch.Generator().manual_seed(3)
        parts = [(x, sample_targets(o, "cross_entropy", generator=gen)) for (x, _), o in zip(parts, outs)]
        weights = [1.0] * k
    else:  # row = M · (its term of the accumulated gradient)
        weights = [M * c / len(y) for (_, y), c in zip(parts, _factors(parts, scaling))]
    _check(delta, _dense(ref_model, parts, weights, g, layer_params(model)), set(g))
    assert opt.curvature_steps == 1


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_sequences_of_other_lengths(fisher: str) -> None:
    """Micro-batches of 4- and 7-token sequences: the records' positions are zero-padded."""
    template, model = _model("pool")
    opt = _optimizer(model, fisher=fisher)
    opt.seed_mc(4)
    parts = [_seq_batch(3, 1, length=4), _seq_batch(5, 2, length=7)]
    ref_model = snapshot(template, model)
    outs = _accumulate(model, opt, parts, "share")
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    assert [lay.m for lay in tengrad_fx.covered_layers(model)] == [8] * 4
    delta = step_delta(model, opt)
    if fisher == "mc":
        gen = torch.Generator().manual_seed(4)
        parts = [(x, sample_targets(o, "cross_entropy", generator=gen)) for (x, _), o in zip(parts, outs)]
    _check(delta, _dense(ref_model, parts, [1.0, 1.0], g, layer_params(model)), set(g))


def _whole_vs_accumulated(make: Callable[[], tuple[nn.Module, torch.optim.Optimizer]], parts: list[Part],
                          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], steps: int = 2,
                          targets: Sequence[torch.Tensor] | None = None) -> tuple[Params, Params]:
    """Parameters after ``steps`` steps on the whole batch, and after as many steps with the
    batch split into ``parts`` (each micro-batch's loss times ``m_j/M``). ``targets``: the
    MC Fisher's labels of each part (else the optimizer samples them)."""
    M = sum(len(y) for _, y in parts)
    out = []
    for split in (False, True):
        model, opt = make()
        for _ in range(steps):
            opt.zero_grad()
            pieces = parts if split else [(torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))]
            labels = targets if split or targets is None else [torch.cat(list(targets))]
            for j, (x, y) in enumerate(pieces):
                out_j = model(x)
                opt.mc_capture(out_j, None if labels is None else labels[j])  # no-op for the empirical Fisher
                (loss_fn(out_j, y) * (len(y) / M)).backward()
            opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out[0], out[1]


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(rel(x, y) <= TOL for x, y in zip(a, b)), [rel(x, y) for x, y in zip(a, b)]


def _half_sq(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (out - y).pow(2).sum(1).mean()


@pytest.mark.parametrize("samples", [None, 4, 9])
def test_gauss_newton_is_the_whole_batch_one(samples: int | None) -> None:
    """Each micro-batch runs its own per-output backwards; with ``curvature_samples`` the
    first samples of the union (9: into the second micro-batch; the third runs none)."""
    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(m, 5, generator=g, dtype=torch.float64), torch.randn(m, 2, generator=g, dtype=torch.float64))
             for m in (5, 7, 3)]

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        model = tengrad_fx.prepare(net, example_inputs=(parts[0][0][:2],))
        return model, _optimizer(model, fisher="gauss-newton", curvature_samples=samples)

    _close(*_whole_vs_accumulated(make, parts, _half_sq))


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("samples", [4, 9])
def test_curvature_samples_takes_the_first_rows_of_the_union(fisher: str, samples: int) -> None:
    """``curvature_samples`` (4: within the first micro-batch, 9: into the second) keeps the
    first rows of the union: the whole batch's first rows."""
    parts = _parts("seq", [5, 7])
    targets = [torch.randint(0, 3, (len(y),), generator=torch.Generator().manual_seed(8 + j))
               for j, (_, y) in enumerate(parts)] if fisher == "mc" else None

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model("seq")[1]
        return model, _optimizer(model, fisher=fisher, curvature_samples=samples)

    _close(*_whole_vs_accumulated(make, parts, F.cross_entropy, targets=targets))


@pytest.mark.parametrize("name", ["KFAC", "NGD"])
def test_baselines_use_the_union(name: str) -> None:
    parts = _parts("seq", [4, 4])

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model("seq")[1]
        return model, getattr(tengrad_fx, name)(model, lr=0.1, damping=0.1)

    _close(*_whole_vs_accumulated(make, parts, F.cross_entropy))


def test_zero_grad_between_backwards_starts_afresh() -> None:
    """Without accumulated gradients (``zero_grad()``) a new capture replaces the last one."""
    _, model = _model("seq")
    opt = _optimizer(model)
    (x1, y1), (x2, y2) = _parts("seq", [5, 3])
    F.cross_entropy(model(x1), y1).backward()
    assert tengrad_fx.covered_layers(model)[0].m == 5
    F.cross_entropy(model(x2), y2).backward()  # accumulates
    assert tengrad_fx.covered_layers(model)[0].m == 8
    opt.zero_grad()
    F.cross_entropy(model(x2), y2).backward()
    assert tengrad_fx.covered_layers(model)[0].m == 3
    out = model(x1)
    opt.zero_grad()  # after the forward, before its backward (as Lightning does): afresh too
    F.cross_entropy(out, y1).backward()
    assert tengrad_fx.covered_layers(model)[0].m == 5
    F.cross_entropy(model(x2), y2).backward()
    assert tengrad_fx.covered_layers(model)[0].m == 8
    opt.zero_grad()
    F.cross_entropy(model(x2), y2).backward()
    opt.step()
    F.cross_entropy(model(x1), y1).backward()  # after a step: afresh, though .grad still holds the last one
    assert tengrad_fx.covered_layers(model)[0].m == 5


def test_union_of_records() -> None:
    """A site a micro-batch lacks gets zero rows; positions are zero-padded; the optimizer's
    own-loss rows (MC, Gauss-Newton) are rescaled from their micro-batch's mean to the union's."""
    from tengrad_fx.capture.store import Record, union

    g = torch.Generator().manual_seed(0)

    def rec(m: int, T: int, own: bool) -> Record:
        r = Record(torch.randn(m, T, 3, generator=g), torch.randn(m, T, 2, generator=g))
        r.own_loss = own
        return r

    for own in (False, True):
        a, b, c = rec(2, 4, own), rec(3, 6, own), rec(2, 4, own)
        out = union([{1: [a], 2: [c]}, {1: [b]}], mean=True)
        u, v = out[1][0], out[2][0]
        assert u.m == v.m == 5 and u.loss_batch == 5 and u.in_shape == (5, 6, 3) and u.own_loss == own
        s_a, s_b = (2 / 5, 3 / 5) if own else (1.0, 1.0)
        assert torch.equal(u.I[:2, :4], a.I) and not u.I[:2, 4:].any() and torch.equal(u.I[2:], b.I)
        assert torch.allclose(u.G[:2, :4], a.G * s_a) and not u.G[:2, 4:].any()
        assert torch.allclose(u.G[2:], b.G * s_b)
        assert torch.allclose(v.G[:2], c.G * s_a) and not v.G[2:].any() and not v.I[2:].any()
