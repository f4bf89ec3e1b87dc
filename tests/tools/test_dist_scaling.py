"""``python -m tools.dist_scaling``: the accounting on paper, against formulas derived by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from tengrad_fx.distributed.plan import assign_owners, choose_modes
from testing.repo_tools import tool

scaling, planned = tool("dist_scaling"), tool("dist_planned")

TINY = scaling.Shape("tiny", blocks=1, d=4, heads=1, vocab=10, seq=3)


def _layer(shape: object, name: str) -> object:
    return next(lay for lay in scaling.model_layers(shape) if lay.name == name)


def test_tiny_shape_accounting_is_the_hand_formula() -> None:
    """qkv of a d = 4 model (Linear 4 -> 12 with bias, S = 3 positions), m = 2, W = 2, 4-byte values."""
    m, W, es = 2, 2, 4
    M, S, f, o, n = W * m, 3, 4, 12, 4 * 12 + 12
    qkv = _layer(TINY, "h.0.attn.qkv")
    assert (qkv.n, qkv.dims) == (n, (1, S, f, o))
    ig = m * S * (f + o) * es  # I [m, S, f] and G [m, S, o]: 384 bytes
    costs = scaling.mode_costs([qkv], m, W, k=5, T=10, bandwidth=1e9, flop_rate=1e12)
    # gather: n·m = 120 >= I, G's 96 values, so I, G travel; the owner's u is broadcast (n values)
    g = costs["gather"][0][0]
    assert (g.curv_all, g.curv_others, g.reuse_all, g.curv_recv) == (n * es, ig, n * es, (W - 1) * ig)
    gram = min(2 * M * M * S * S * (f + o), 2 * M * S * f * o + 2 * M * M * f * o)
    per_step = 4 * M * S * f * o + 2 * M * M  # J g and Jᵀc on M rows, two triangular solves
    assert g.curv_flops_owner == pytest.approx(gram + M ** 3 / 3 + per_step) and g.reuse_flops_owner == per_step
    # gram-blocks: J_a g all-gathered ((W−1)·m), c broadcast (M), Jᵀc all-reduced (2(W−1)/W·n)
    b = costs["gram-blocks"][0][0]
    vec = ((W - 1) * m + M + 2 * (W - 1) / W * n) * es
    assert (b.curv_all, b.curv_others, b.reuse_all) == (vec, ig, vec)
    assert b.reuse_flops_all == 4 * m * S * f * o and b.reuse_flops_owner == 2 * M * M
    # local: the all-reduce of u, an m × m Gram on every rank
    loc = costs["local"][0][0]
    assert loc.reuse_all == 2 * (W - 1) / W * n * es and loc.curv_others == 0
    assert loc.curv_flops_all == pytest.approx(min(2 * m * m * S * S * (f + o), 2 * m * S * f * o + 2 * m * m * f * o)
                                               + m ** 3 / 3 + 4 * m * S * f * o + 2 * m * m)
    # rows, k = 5: at most ⌈5/2⌉ = 3 rows of (f + o) values per rank; the owner receives 5 − ⌊5/2⌋ = 3
    r = costs["rows"][0][0]
    assert (r.curv_all, r.curv_others, r.curv_recv) == (n * es, 3 * (f + o) * es, 3 * (f + o) * es)
    assert r.curv_flops_owner == pytest.approx(min(2 * 25 * (f + o), 2 * 5 * f * o + 2 * 25 * f * o) + 125 / 3
                                               + 4 * 5 * f * o + 2 * 25)


def test_gather_sends_per_sample_gradients_where_smaller() -> None:
    """At S = 64 positions the qkv's P (n_w + o = 60 values per sample) is smaller than I, G
    (64·16) and the owner materializes: gather sends P and its bias sums, gram-blocks I, G."""
    shape = TINY._replace(seq=64)
    m, W = 2, 2
    qkv = _layer(shape, "h.0.attn.qkv")
    costs = scaling.mode_costs([qkv], m, W, k=5, T=10, bandwidth=1e9, flop_rate=1e12)
    assert costs["gather"][0][0].curv_others == m * (4 * 12 + 12) * 4
    assert costs["gram-blocks"][0][0].curv_others == m * 64 * (4 + 12) * 4


def test_rank_totals_put_records_and_owner_work_where_they_belong() -> None:
    a = planned.LayerCost(1.0, 10.0, 2.0, 0.5, 100.0, 0.25, 7.0, 30.0)
    b = planned.LayerCost(3.0, 20.0, 4.0, 0.0, 50.0, 0.0, 5.0, 60.0)
    tot = scaling.rank_totals([a, b], [0, 2], 3)
    assert tot.curv_bytes == [4 + 20, 4 + 10 + 20, 4 + 10]
    assert tot.reuse_bytes == [6.0] * 3 and tot.curv_recv == [30.0, 0.0, 60.0]
    assert tot.curv_flops == [100.5, 0.5, 50.5] and tot.reuse_flops == [7.25, 0.25, 5.25]
    b_amort, secs = tot.amortized(4, bandwidth=2.0, flop_rate=1.0)
    assert b_amort[1] == pytest.approx((34 + 3 * 6) / 4) and secs[1] == pytest.approx(b_amort[1] / 2 + (0.5 + 0.75) / 4)


def test_rank_reduced_rows_do_not_grow_with_the_world() -> None:
    """At a fixed k the rows' curvature step is bounded by k: what a rank sends and what an
    owner receives are the same or fewer bytes at W = 2, 4 and 1 024; gather's owner receives
    W − 1 ranks' records."""
    shape, m, k = scaling.SHAPES["gpt2-small"], 8, 4096
    rows = {r["W"]: r for r in scaling.scaling_rows(shape, [2, 4, 1024], m, k, 40, 50e9, 50e12)}
    sent = [rows[W]["rows"]["curv"] for W in (2, 4, 1024)]
    recv = [rows[W]["rows"]["recv"] for W in (2, 4, 1024)]
    assert sent[0] >= sent[1] >= sent[2] and recv[0] >= recv[2]
    layers = scaling.model_layers(shape)
    bound = sum(k * lay.ig / lay.dims[1] for lay in layers)  # every layer's k rows to one owner
    assert max(recv) <= bound
    assert rows[1024]["gather"]["recv"] > 100 * rows[2]["gather"]["recv"]


def test_newton_schulz_flops_follow_the_form_the_code_takes() -> None:
    s = 5
    A, B = 3, 4  # small: X itself, s·(4A²B + 2A³)
    assert planned.newton_schulz_flops(4, 3) == s * (4 * A * A * B + 2 * A ** 3)
    A, B = 512, 8192  # wide: the A × A Gram side, 4A²B + 8sA³
    assert planned.newton_schulz_flops(A, B) == 4 * A * A * B + 8 * s * A ** 3


def test_owner_polar_bytes_and_flops() -> None:
    """Two matrices on two ranks, rows split in halves: each rank sends its shard of the
    other's matrix and the other's shard of its own back."""
    pc = planned.owner_polar_cost([(4, 3), (2, 5)], 2)
    assert pc.owners == [0, 1] and pc.flops == [990.0, 480.0] and pc.total == 1470.0
    assert pc.sent == [1 * 5 * 4 + 2 * 3 * 4, 2 * 3 * 4 + 1 * 5 * 4]


@pytest.mark.parametrize("W", [2, 8, 64, 1024])
def test_owner_polar_flops_per_rank_at_most_an_even_share_and_one_matrix(W: int) -> None:
    shapes = [lay.matrix for lay in scaling.model_layers(scaling.SHAPES["gpt2-small"])]
    pc = planned.owner_polar_cost(shapes, W)
    biggest = max(planned.newton_schulz_flops(a, b) for a, b in shapes)
    assert max(pc.flops) <= pc.total / W + biggest and sum(pc.flops) == pytest.approx(pc.total)


def test_auto_is_the_plan_rule_on_the_shapes() -> None:
    """``auto_modes`` is ``plan.choose_modes`` with owners by solve cost and each layer's
    records by hand (P where gather sends it, else I, G); at W = 16 it mixes both modes
    and ``mode_costs["auto"]`` takes each layer's cost from the mode picked."""
    from tengrad_fx.distributed.plan import solve_cost
    shape, m, W, T = scaling.SHAPES["gpt2-small"], 8, 16, 40
    layers = scaling.model_layers(shape)
    M = W * m
    owners = assign_owners([solve_cost(M, lay.dims) for lay in layers], W)
    recs = []
    for lay in layers:
        ig = m * lay.ig
        p = m * (lay.n_w + lay.dims[3]) * 4  # P and the bias sums
        sends_p = lay.kind == "linear" and lay.n * m < m * lay.ig_numel  # materializing at S = 1024, M = 128
        recs.append((p if sends_p else ig, ig))
    want = choose_modes(M, [lay.n for lay in layers], [lay.dims for lay in layers], owners, W, 50e9, 50e12, recs, T)
    got = scaling.auto_modes(layers, m, W, T, 50e9, 50e12)
    assert got == want and set(got) == {"gather", "gram-blocks"}
    costs = scaling.mode_costs(layers, m, W, 4096, T, 50e9, 50e12)
    for i, md in enumerate(got):
        assert costs["auto"][0][i] == costs[md][0][i]


def test_cli_prints_the_tables_and_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "scaling.png"
    scaling.main(["--models", "gpt2-small,gpt2-1.3b", "--worlds", "2,1024", "--layer-world", "8",
                  "--plot", str(png)])
    out = capsys.readouterr().out
    assert "### GPT-2 small (124M)" in out and "### 1.3B" in out and "| 1024 | 8192 |" in out
    assert "Per layer at W = 8" in out and "| mlp.fc (x24) |" in out and f"plot written to {png}" in out
    assert png.stat().st_size > 1000
    with pytest.raises(SystemExit):
        scaling.main(["--models", "gpt2-xl"])
