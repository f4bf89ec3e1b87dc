"""``TENGraD(position_rows=k)``: one row of ``J`` per (sample, position), ``k`` of them drawn.

Reference (float64, ``testing.oracle``): on a model whose outputs at position ``t`` depend on
its input at ``t`` only (Embedding → LayerNorm → Linear → Tanh → Linear (or Hugging Face's
transposed ``Conv1D``) → Linear, the output layer tied to the embedding or not) under the
mean cross-entropy over every position, row ``(i, t)`` is ``∇ℓ_it``: ``vmap(grad)`` of each
position run as a sequence of one. Per Linear / Embedding ``u = solve(J_kᵀJ_k/k + αI, g)``
with ``J_k`` the rows the optimizer drew (the same draw replayed from the seeded generator)
and ``g`` the whole batch's gradient; the LayerNorm keeps one row per sequence
(``vmap(grad)`` over the sequences), so the step solves Grams of two sizes together.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad.metric import FLOOR, Metric
from tengrad_fx.optim.tengrad.position_rows import scored_draw
from tengrad_fx.utils.dispatch import SyncCounter
from testing.oracle import dense_layer_updates, per_sample_grads_reference
from testing.tengrad_step import assert_matches, dense_u, full_grad, layer_params, snapshot, step_delta

V, D, H = 7, 5, 6
M, S, ALPHA, SEED = 3, 4, 0.05, 11


class TinyLM(nn.Module):
    """Tokens ``[B, S]`` → logits ``[B, S, V]``, position by position."""

    def __init__(self, tied: bool, conv1d: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, H)
        if conv1d:  # Hugging Face's transposed Linear, weight [d_in, d_out]
            from transformers.pytorch_utils import Conv1D
            self.proj: nn.Module = Conv1D(D, H)
        else:
            self.proj = nn.Linear(H, D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tok: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``attention_mask`` is not read: the optimizer takes it as the scored positions."""
        return self.head(self.proj(torch.tanh(self.fc(self.norm(self.emb(tok))))))


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def _batch(seed: int, m: int = M) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (m, S), generator=g), torch.randint(0, V, (m, S), generator=g)


def _setup(tied: bool = False, conv1d: bool = False, **kw):
    torch.manual_seed(0)
    net = TinyLM(tied, conv1d).double()
    template = copy.deepcopy(net)
    model = tengrad_fx.prepare(net, example_inputs=(_batch(99, 2)[0],))
    args = dict(lr=1.0, damping=ALPHA, momentum=0.0, weight_decay=0.0, curvature_every=100, kl_clip=None,
                position_rows=5)
    args.update(kw)
    opt = TENGraD(model, **args)
    opt.seed_mc(SEED)
    return template, model, opt


def _drawn(k: int, n: int = M * S) -> torch.Tensor:
    """The rows the optimizer's first draw takes (its generator seeded as ``seed_mc(SEED)``)."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(SEED))[:k]


def _position_layers(model: nn.Module) -> dict[str, list[str]]:
    """The covered layers that take position rows (all but the LayerNorm)."""
    return {name: ps for name, ps in layer_params(model).items() if name != "norm"}


def _positions(tok: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drawn positions as sequences of one: ``[k, 1]`` each."""
    return tok.reshape(-1)[idx].unsqueeze(1), y.reshape(-1)[idx].unsqueeze(1)


def _step(model, opt, tok, y, targets=None):
    out = model(tok)
    opt.zero_grad()
    if targets is not None:
        opt.mc_capture(out, targets=targets)
    lm_loss(out, y).backward()
    return step_delta(model, opt)


@pytest.mark.parametrize("tied, conv1d", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("k", [5, M * S, 4 * M * S])
def test_curvature_and_reuse_steps_equal_dense_ngd_on_position_rows(tied: bool, conv1d: bool, k: int) -> None:
    """Step 1 draws ``min(k, m·S)`` position rows; step 2 reuses them with its own gradient."""
    if conv1d:
        pytest.importorskip("transformers")
    template, model, opt = _setup(tied, conv1d, position_rows=k)
    layers = _position_layers(model)
    assert set(layers) == ({"head", "fc", "proj"} if tied else {"emb", "fc", "proj", "head"})
    (t1, y1), (t2, y2) = _batch(1), _batch(2)
    xJ, yJ = _positions(t1, y1, _drawn(k))
    ref1 = snapshot(template, model)
    for tok, y in ((t1, y1), (t2, y2)):
        g = full_grad(snapshot(template, model), tok, y, lm_loss)
        ref = {**dense_u(ref1, xJ, yJ, lm_loss, g, ALPHA, layers),
               **dense_u(ref1, t1, y1, lm_loss, g, ALPHA, {"norm": ["norm.weight", "norm.bias"]})}
        assert_matches(_step(model, opt, tok, y), ref)
    covered = {lay.name: lay for lay in opt._layers}
    recs = [r for name, lay in covered.items() if name != "norm" for r in lay.records()]
    assert recs and all(r.m == min(k, M * S) and r.loss_batch == M for r in recs)
    assert [r.m for r in covered["norm"].records()] == [M]
    assert opt.curvature_steps == 1


def test_mc_fisher_rows_are_the_sampled_labels_positions() -> None:
    template, model, opt = _setup(fisher="mc")
    layers = _position_layers(model)
    tok, y = _batch(3)
    t = torch.randint(0, V, (M, S), generator=torch.Generator().manual_seed(7))
    g = full_grad(snapshot(template, model), tok, y, lm_loss)
    xJ, tJ = _positions(tok, t, _drawn(5))
    ref = {**dense_u(snapshot(template, model), xJ, tJ, lm_loss, g, ALPHA, layers),
           **dense_u(snapshot(template, model), tok, t, lm_loss, g, ALPHA, {"norm": ["norm.weight", "norm.bias"]})}
    assert_matches(_step(model, opt, tok, y, targets=t), ref)


@pytest.mark.parametrize("steps", [1, 2])
def test_with_the_factored_metric(steps: int) -> None:
    """``metric="factored"`` on the drawn rows: ``u = (F_k + αD)⁻¹ g`` with ``D = a ⊗ b``
    (``a = √r/mean(√r)``, ``b = √c/mean(√c)`` of the EMAs (``β₂ = 0.9``) of the row and column
    means of ``g²``; a bias takes ``a``), built here: of the first step's, or (``steps = 2``,
    ``root_every = 1``) on the reuse step, of both steps' gradients with the first step's rows."""
    template, model, opt = _setup(metric=Metric("factored", beta2=0.9, root_every=1))
    layers = _position_layers(model)
    moments: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(steps):
        tok, y = _batch(4 + step)
        ref_model = snapshot(template, model)
        if step == 0:
            curv = ref_model, *_positions(tok, y, _drawn(5))
        g = full_grad(ref_model, tok, y, lm_loss)
        D = {}
        for names in layers.values():
            r0, c0 = moments.get(names[0], (0.0, 0.0))
            r, c = (0.9 * old + 0.1 * new for old, new in ((r0, g[names[0]].square().mean(1)),
                                                           (c0, g[names[0]].square().mean(0))))
            moments[names[0]] = r, c
            a, b = ((m.sqrt() / m.sqrt().mean()).clamp_min(FLOOR) for m in (r, c))
            D[names[0]] = a[:, None] * b[None, :]
            D.update({n: a for n in names[1:]})
        covered = {pn: lay for lay, names in layers.items() for pn in names}
        ref = {**dense_layer_updates(*curv, lm_loss, g, ALPHA, covered, metric=D),
               **dense_u(curv[0], *_batch(4), lm_loss, g, ALPHA, {"norm": ["norm.weight", "norm.bias"]})}
        assert_matches(_step(model, opt, tok, y), ref)


def test_relative_damping_takes_each_layers_own_rows() -> None:
    """``relative_damping``: ``α_l = α·Σ_rows ‖j‖²/m_l²`` over the layer's own rows, ``k``
    position rows or ``m`` sequences (the norm), though the Grams are padded to one size."""
    template, model, opt = _setup(relative_damping=True)
    tok, y = _batch(5)
    ref_model = snapshot(template, model)
    g = full_grad(ref_model, tok, y, lm_loss)
    xJ, yJ = _positions(tok, y, _drawn(5))
    ref = {}
    for name, names in layer_params(model).items():
        rows = (tok, y) if name == "norm" else (xJ, yJ)
        psg = per_sample_grads_reference(ref_model, rows[0], lm_loss, rows[1])
        alpha = ALPHA * sum(float(psg[n].square().sum()) for n in names) / rows[0].shape[0] ** 2
        ref.update(dense_u(ref_model, *rows, lm_loss, g, alpha, {name: names}))
    assert_matches(_step(model, opt, tok, y), ref)


def test_layers_without_positions_are_unchanged_bit_for_bit() -> None:
    """An MLP on ``[m, d]`` has one position per sample: the same steps as without the option."""
    def train(**kw) -> list[torch.Tensor]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        model = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 6, dtype=torch.float64),))
        opt = TENGraD(model, lr=0.1, damping=0.1, curvature_every=2, **kw)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(train(position_rows=3), train()))


def test_sequence_layers_start_factored() -> None:
    """No position layer is materialized, not even before the first curvature step."""
    _, model, opt = _setup(strategy="materialize")
    info = tengrad_fx.get_info(model)
    position = {site for lay in opt._layers if lay.name != "norm" for site in lay.spec.sites}
    assert info.store.jacobian_sites and not info.store.jacobian_sites & position  # the norm is materialized
    for s in (1, 2):
        _step(model, opt, *_batch(s))
        assert all(r.P is None for site in position for r in info.store.records[site])


def test_state_dict_round_trip_is_bit_identical() -> None:
    """Saved after a curvature step (the drawn rows and the generator), a resumed optimizer's
    reuse step and its next curvature step equal the uninterrupted one's."""
    _, model, opt = _setup(curvature_every=2)
    _step(model, opt, *_batch(1))
    sd = copy.deepcopy(opt.state_dict())
    _, model2, opt2 = _setup(curvature_every=2)
    opt2.seed_mc(SEED + 1)  # replaced by the saved generator state
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    for s in (2, 3):
        deltas = [_step(mdl, o, *_batch(s)) for mdl, o in ((model, opt), (model2, opt2))]
        assert all(torch.equal(deltas[0][n], deltas[1][n]) for n in deltas[0])
    assert opt2.curvature_steps == 2


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "32"])
def test_bad_k_is_refused(bad) -> None:
    _, model, _ = _setup()
    with pytest.raises(ValueError, match="position_rows"):
        TENGraD(model, lr=0.1, damping=0.1, position_rows=bad)


@pytest.mark.parametrize("kw", [dict(curvature_samples=4), dict(fisher="gauss-newton")])
def test_combinations_it_cannot_serve_are_refused(kw) -> None:
    _, model, _ = _setup()
    with pytest.raises(ValueError, match="position_rows"):
        TENGraD(model, lr=0.1, damping=0.1, position_rows=8, **kw)


def test_language_model_preset_takes_position_rows() -> None:
    """``make_optimizer("tengrad", model, preset="lm")``: position rows (all ``m·S`` here,
    fewer than 512), the factored metric, MC labels from the plain loop, finite steps."""
    torch.manual_seed(0)
    model = tengrad_fx.prepare(TinyLM(tied=True), example_inputs=(_batch(99, 2)[0],))
    opt = tengrad_fx.make_optimizer("tengrad", model, preset="lm")
    assert (opt.position_rows, opt.schedule.every, opt.kl_clip, opt.graft, opt.fisher) == \
        (512, 40, None, "rmsprop", "mc")
    assert opt.metric is not None
    before = [p.detach().clone() for p in model.parameters()]
    for s in range(3):
        tok, y = _batch(s)
        opt.zero_grad()
        lm_loss(model(tok), y).backward()
        opt.step()
    info = tengrad_fx.get_info(model)
    fc = next(lay for lay in opt._layers if lay.name == "fc")
    assert [r.I.shape[0] for r in info.store.records[fc.spec.sites[0]]] == [M * S]
    assert opt.counters["skipped"] == 0
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(model.parameters(), before))


# --------------------------------------------------------------------------- scored positions only
def _scored(seed: int, n: int) -> torch.Tensor:
    """Bool ``[M, S]`` with ``n`` scored positions at random."""
    flat = torch.zeros(M * S, dtype=torch.bool)
    flat[torch.randperm(M * S, generator=torch.Generator().manual_seed(seed))[:n]] = True
    return flat.reshape(M, S)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("k, n", [(3, 7), (5, 5), (9, 4)])
def test_rows_are_drawn_among_the_scored_positions(fisher: str, k: int, n: int) -> None:
    """Padding (``attention_mask`` 0, labels −100): the loss is the mean over the ``n`` scored
    positions; ``min(k, n)`` rows are drawn among them only, and the step is dense NGD on
    those rows (``∇ℓ_it``, ``F = JᵀJ/min(k, n)``); the LayerNorm's row per sequence is
    ``(m/n)·Σ_t ∇ℓ_it``. The MC labels are given, so both Fishers take the same rows."""
    template, model, opt = _setup(fisher=fisher, position_rows=k)
    layers = _position_layers(model)
    scored = _scored(k + n, n)
    tok, y = _batch(6)
    y = y.masked_fill(~scored, -100)
    t = torch.randint(0, V, (M, S), generator=torch.Generator().manual_seed(8)).masked_fill(~scored, -100)
    ref_model = snapshot(template, model)
    g = full_grad(ref_model, tok, y, lm_loss)
    idx, w = scored_draw(scored, k, torch.Generator().manual_seed(SEED))
    drawn = idx[w > 0]
    assert drawn.numel() == min(k, n) and bool(scored.reshape(-1)[drawn].all())
    rows = t if fisher == "mc" else y
    xJ, yJ = _positions(tok, rows, drawn)
    per_seq = lambda out, lab: F.cross_entropy(out.reshape(-1, V), lab.reshape(-1), reduction="sum") * M / n
    ref = {**dense_u(ref_model, xJ, yJ, lm_loss, g, ALPHA, layers),
           **dense_u(ref_model, tok, rows, per_seq, g, ALPHA, {"norm": ["norm.weight", "norm.bias"]})}
    out = model(tok, attention_mask=scored.long())
    opt.zero_grad()
    if fisher == "mc":
        opt.mc_capture(out, targets=t)
    lm_loss(out, y).backward()
    assert_matches(step_delta(model, opt), ref)


def test_the_scored_draw_reads_nothing_back() -> None:
    """The masked draw and the rows' weights stay on the device (0 host syncs), also when
    fewer positions are scored than rows are asked for."""
    for n in (2, 9):
        with SyncCounter() as sc:
            idx, w = scored_draw(_scored(1, n), 5, torch.Generator().manual_seed(0))
        assert sc.count == 0, dict(sc.ops)
        assert idx.shape == (5,) and int((w > 0).sum()) == min(5, n)
