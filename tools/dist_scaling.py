"""``python -m tools.dist_scaling``: distributed TENGraD at scale, on paper (no process group).

    python -m tools.dist_scaling [--models gpt2-small,gpt2-350m,gpt2-1.3b] [--worlds 2,4,...,1024]
                                 [--seqs 8] [--rows 4096] [--T 40] [--bandwidth 50e9] [--flop-rate 50e12]
                                 [--layer-world 64] [--plot out.png]

The shapes of GPT-2-like models (:data:`SHAPES`; per block the Linears ``attn.qkv``
``d→3d``, ``attn.proj`` ``d→d``, ``mlp.fc`` ``d→4d``, ``mlp.proj`` ``4d→d`` with biases,
plus the token embedding ``wte`` and an untied head ``d→vocab``; position embedding and
layer norms left out), ``--seqs`` sequences of ``seq`` tokens per rank (``m``; ``M = W·m``),
4-byte records, per rank and per step, the busiest rank's:

* bytes sent, on a curvature step and on a reuse step, and amortized over
  ``curvature_every = T``, in each mode — ``gather``, ``gram-blocks`` and ``local`` from
  :mod:`tengrad_fx.distributed.traffic` (what ``comm_bytes`` counts) with the records as
  :mod:`tengrad_fx.distributed.records` sends them (``P`` where smaller), ``auto`` per layer
  as :func:`tengrad_fx.distributed.plan.choose_modes` picks, and the planned rank-reduced rows
  (``--rows`` = ``k``) and owner polar factor (:mod:`tools.dist_planned`);
* flops: Gram and Cholesky (:func:`~tengrad_fx.distributed.plan.solve_cost`), ``J g`` / ``Jᵀc``
  (:func:`~tengrad_fx.distributed.plan.step_flops`) and the two triangular solves
  (:func:`~tengrad_fx.distributed.plan.solve_flops`), owners by
  :func:`~tengrad_fx.distributed.plan.assign_owners`; Newton–Schulz for the polar factor;
* the modeled time of a step (amortized), ``bytes/bandwidth + flops/flop_rate`` on the
  busiest rank, the cost model ``mode="auto"`` minimizes.

Placement is ``owner`` for every layer; the push-through probe's values (empirical
curvature steps of gram-blocks layers) are not counted. ``--plot`` writes the modeled
time per step against ``W`` (matplotlib; skipped with a note if it is missing).
"""
from __future__ import annotations

import argparse
from typing import Any, NamedTuple, Sequence

from tengrad_fx.distributed.plan import assign_owners, choose_modes, solve_cost, solve_flops, step_flops
from tengrad_fx.distributed.records import per_sample_bytes, per_sample_smaller
from tengrad_fx.distributed.traffic import all_reduce_sent, blocks_step_sent, gather_sent, gather_step_sent
from tools.dist_planned import LayerCost, newton_schulz_flops, owner_polar_cost, rows_layer_cost

__all__ = ["Shape", "Layer", "SHAPES", "model_layers", "mode_costs", "auto_modes", "Totals", "rank_totals",
           "scaling_rows", "layer_rows", "report", "plot", "main"]

MODES = ("gather", "gram-blocks", "auto", "rows", "local")
INDEX_BYTES = 8  # an embedding's records keep int64 indices


class Shape(NamedTuple):
    """A GPT-2-like model: ``blocks`` of width ``d``, ``vocab`` tokens, ``seq`` positions."""
    label: str
    blocks: int
    d: int
    heads: int
    vocab: int = 50257
    seq: int = 1024


SHAPES = {"gpt2-small": Shape("GPT-2 small (124M)", 12, 768, 12), "gpt2-350m": Shape("350M", 24, 1024, 16),
          "gpt2-1.3b": Shape("1.3B", 24, 2048, 16)}


class Layer(NamedTuple):
    """A covered layer: ``kind`` (``"linear"`` / ``"embedding"``), ``n`` parameters
    (``n_w`` of the weight), ``dims = (g, S, f, o)`` of one sample, ``ig`` bytes of one
    sample's records ``I``, ``G`` (``S`` positions), ``ig_numel`` their values, the weight's
    ``matrix`` shape ``[a, b]``."""
    name: str
    group: str
    kind: str
    n: int
    n_w: int
    dims: tuple[int, int, int, int]
    ig: float
    ig_numel: int
    matrix: tuple[int, int]


def _linear(name: str, group: str, f: int, o: int, S: int, bias: bool = True, es: int = 4) -> Layer:
    return Layer(name, group, "linear", f * o + (o if bias else 0), f * o, (1, S, f, o), float(S * (f + o) * es),
                 S * (f + o), (o, f))


def model_layers(shape: Shape, es: int = 4) -> list[Layer]:
    """The covered layers of ``shape`` in graph order (module docstring)."""
    d, S, V = shape.d, shape.seq, shape.vocab
    out = [Layer("wte", "wte", "embedding", V * d, V * d, (1, S, V, d), float(S * (INDEX_BYTES + d * es)),
                 S * (1 + d), (V, d))]
    for i in range(shape.blocks):
        out += [_linear(f"h.{i}.attn.qkv", "attn.qkv", d, 3 * d, S), _linear(f"h.{i}.attn.proj", "attn.proj", d, d, S),
                _linear(f"h.{i}.mlp.fc", "mlp.fc", d, 4 * d, S), _linear(f"h.{i}.mlp.proj", "mlp.proj", 4 * d, d, S)]
    return out + [_linear("head", "head", d, V, S, bias=False)]


def _gather(lay: Layer, m: int, W: int, es: int) -> LayerCost:
    M = W * m
    sends_p = lay.kind == "linear" and per_sample_smaller(lay.n, m, m * lay.ig_numel, M, lay.dims, "auto")
    rec = per_sample_bytes(m, lay.n_w, lay.dims, es) if sends_p else m * lay.ig
    per_step = step_flops(M, lay.dims) + solve_flops(M)
    u = gather_step_sent(lay.n, es)
    return LayerCost(u, gather_sent(rec, False), u, 0.0, solve_cost(M, lay.dims) + per_step, 0.0, per_step,
                     (W - 1) * rec)  # the owner receives every other rank's part


def _blocks(lay: Layer, m: int, W: int, es: int) -> LayerCost:
    M = W * m
    vec = blocks_step_sent(m, W, lay.n, es)
    mine = step_flops(m, lay.dims)
    return LayerCost(vec, gather_sent(m * lay.ig, False), vec, mine, solve_cost(M, lay.dims) + solve_flops(M),
                     mine, solve_flops(M), (W - 1) * m * lay.ig)


def _local(lay: Layer, m: int, W: int, es: int) -> LayerCost:
    mean = all_reduce_sent(lay.n * es, W)
    per_step = step_flops(m, lay.dims) + solve_flops(m)
    return LayerCost(mean, 0.0, mean, solve_cost(m, lay.dims) + per_step, 0.0, per_step, 0.0)


def mode_costs(layers: Sequence[Layer], m: int, W: int, k: int, T: int, bandwidth: float, flop_rate: float,
               es: int = 4) -> dict[str, tuple[list[LayerCost], list[int]]]:
    """Per mode of :data:`MODES`: each layer's :class:`~tools.dist_planned.LayerCost` and owner;
    ``auto``: each layer's cost in the mode :func:`~tengrad_fx.distributed.plan.choose_modes`
    picks (the ``gram-blocks`` ones at :func:`auto_modes`)."""
    M = W * m
    owners = assign_owners([solve_cost(M, lay.dims) for lay in layers], W)
    gather = [_gather(lay, m, W, es) for lay in layers]
    blocks = [_blocks(lay, m, W, es) for lay in layers]
    picks = auto_modes(layers, m, W, T, bandwidth, flop_rate, es)
    auto = [b if md == "gram-blocks" else g for g, b, md in zip(gather, blocks, picks)]
    rows = [rows_layer_cost(k, W, lay.n, lay.dims, lay.ig / lay.dims[1], es) for lay in layers]
    row_owners = assign_owners([solve_cost(k, (lay.dims[0], 1, *lay.dims[2:])) for lay in layers], W)
    return {"gather": (gather, owners), "gram-blocks": (blocks, owners), "auto": (auto, owners),
            "rows": (rows, row_owners), "local": ([_local(lay, m, W, es) for lay in layers], owners)}


def auto_modes(layers: Sequence[Layer], m: int, W: int, T: int, bandwidth: float, flop_rate: float,
               es: int = 4) -> list[str]:
    """What ``mode="auto"`` picks per layer: :func:`~tengrad_fx.distributed.plan.choose_modes`
    on the shapes, owners and records as the optimizer passes them."""
    M = W * m
    owners = assign_owners([solve_cost(M, lay.dims) for lay in layers], W)
    recs = [(_gather(lay, m, W, es).curv_others, m * lay.ig) for lay in layers]
    return choose_modes(M, [lay.n for lay in layers], [lay.dims for lay in layers], owners, W, bandwidth, flop_rate,
                        recs, T)


class Totals(NamedTuple):
    """Per rank (lists of ``W``): bytes sent and flops on a curvature and a reuse step,
    records received on a curvature step."""
    curv_bytes: list[float]
    reuse_bytes: list[float]
    curv_flops: list[float]
    reuse_flops: list[float]
    curv_recv: list[float]

    def amortized(self, T: int, bandwidth: float, flop_rate: float) -> tuple[list[float], list[float]]:
        """Per rank: bytes and seconds of a step amortized over ``T`` (one curvature step)."""
        b = [(c + (T - 1) * r) / T for c, r in zip(self.curv_bytes, self.reuse_bytes)]
        f = [(c + (T - 1) * r) / T for c, r in zip(self.curv_flops, self.reuse_flops)]
        return b, [x / bandwidth + y / flop_rate for x, y in zip(b, f)]


def rank_totals(costs: Sequence[LayerCost], owners: Sequence[int], W: int) -> Totals:
    """Every rank's sums over the layers (``*_all`` everywhere, ``*_owner`` on the owner,
    ``curv_others`` on the other ranks, ``curv_recv`` on the owner)."""
    others = sum(c.curv_others for c in costs)
    cb, rb = sum(c.curv_all for c in costs), sum(c.reuse_all for c in costs)
    cf, rf = sum(c.curv_flops_all for c in costs), sum(c.reuse_flops_all for c in costs)
    tot = Totals([cb + others] * W, [rb] * W, [cf] * W, [rf] * W, [0.0] * W)
    for c, r in zip(costs, owners):
        tot.curv_recv[r] += c.curv_recv
        tot.curv_bytes[r] -= c.curv_others
        tot.curv_flops[r] += c.curv_flops_owner
        tot.reuse_flops[r] += c.reuse_flops_owner
    return tot


def scaling_rows(shape: Shape, worlds: Sequence[int], m: int, k: int, T: int, bandwidth: float,
                 flop_rate: float, es: int = 4) -> list[dict[str, Any]]:
    """One row per ``W``: per mode the busiest rank's ``curv``/``reuse``/``amortized``
    bytes sent, the records the busiest owner receives (``recv``), ``curv_flops`` /
    ``reuse_flops`` and ``seconds`` per step (amortized); ``ddp``: the gradient all-reduce;
    ``polar``: the owner polar factor's busiest rank's bytes (``sent``) and ``flops``, and
    every matrix's (``total``); ``auto_blocks``: the layers ``auto`` makes gram-blocks;
    ``fastest``: the fastest exact mode (gather, gram-blocks or auto)."""
    layers = model_layers(shape, es)
    N = sum(lay.n for lay in layers)
    out = []
    for W in worlds:
        row: dict[str, Any] = {"W": W, "M": W * m, "ddp": all_reduce_sent(N * es, W), "layers": len(layers)}
        for mode, (costs, owners) in mode_costs(layers, m, W, k, T, bandwidth, flop_rate, es).items():
            tot = rank_totals(costs, owners, W)
            amort, secs = tot.amortized(T, bandwidth, flop_rate)
            row[mode] = {"curv": max(tot.curv_bytes), "reuse": max(tot.reuse_bytes), "amortized": max(amort),
                         "recv": max(tot.curv_recv),
                         "curv_flops": max(tot.curv_flops), "reuse_flops": max(tot.reuse_flops), "seconds": max(secs)}
        polar = owner_polar_cost([lay.matrix for lay in layers], W, es)
        row["polar"] = {"sent": max(polar.sent), "flops": max(polar.flops), "total": polar.total}
        row["auto_blocks"] = auto_modes(layers, m, W, T, bandwidth, flop_rate, es).count("gram-blocks")
        row["fastest"] = min(("gather", "gram-blocks", "auto"), key=lambda md: row[md]["seconds"])
        out.append(row)
    return out


def layer_rows(shape: Shape, W: int, m: int, k: int, T: int, bandwidth: float, flop_rate: float,
               es: int = 4) -> list[dict[str, Any]]:
    """Per layer group (``attn.qkv`` …, each block's alike): its count and ``n``, one
    layer's bytes on a non-owner (curvature, reuse) and flops on its owner (curvature,
    reuse) per mode, its Newton–Schulz flops, and how many of the group ``auto``
    makes gram-blocks."""
    layers = model_layers(shape, es)
    costs = mode_costs(layers, m, W, k, T, bandwidth, flop_rate, es)
    picks = auto_modes(layers, m, W, T, bandwidth, flop_rate, es)
    out: dict[str, dict[str, Any]] = {}
    for i, lay in enumerate(layers):
        if lay.group in out:
            out[lay.group]["count"] += 1
            out[lay.group]["blocks"] += picks[i] == "gram-blocks"
            continue
        row: dict[str, Any] = {"group": lay.group, "count": 1, "n": lay.n, "blocks": int(picks[i] == "gram-blocks"),
                               "polar_flops": newton_schulz_flops(*lay.matrix)}
        for mode in ("gather", "gram-blocks", "rows", "local"):
            c = costs[mode][0][i]
            row[mode] = {"curv": c.curv_all + c.curv_others, "reuse": c.reuse_all,
                         "curv_flops": c.curv_flops_all + c.curv_flops_owner,
                         "reuse_flops": c.reuse_flops_all + c.reuse_flops_owner}
        out[lay.group] = row
    return list(out.values())


def _num(x: float) -> str:
    """Three significant digits, thousands grouped by a space."""
    return f"{x:,.0f}".replace(",", " ") if abs(x) >= 100 else f"{x:.3g}"


def _pair(d: dict[str, float], scale: float, a: str = "curv", b: str = "reuse") -> str:
    return f"{_num(d[a] / scale)} / {_num(d[b] / scale)}"


def report(shape: Shape, rows: Sequence[dict[str, Any]], layers: Sequence[dict[str, Any]], m: int, k: int,
           T: int, layer_world: int) -> str:
    """The markdown tables of one model: bytes, flops and modeled time per ``W``; per layer
    group at ``layer_world``."""
    MiB, GiB, TF, GF = 2.0 ** 20, 2.0 ** 30, 1e12, 1e9
    out = [f"### {shape.label}: {rows[0]['layers']} layers, d = {shape.d}, m = {m} x {shape.seq} tokens per rank",
           "", f"MiB sent per step by the busiest rank (curvature / reuse step; auto also amortized over T = {T}):", "",
           f"| W | M | DDP | gather | gram-blocks | auto | auto amortized | rows k={k} | local | owner polar |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['W']} | {r['M']} | {_num(r['ddp'] / MiB)} | {_pair(r['gather'], MiB)} | "
                   f"{_pair(r['gram-blocks'], MiB)} | {_pair(r['auto'], MiB)} | {_num(r['auto']['amortized'] / MiB)} | "
                   f"{_pair(r['rows'], MiB)} | {_num(r['local']['reuse'] / MiB)} | {_num(r['polar']['sent'] / MiB)} |")
    out += ["", f"GiB of records the busiest owner receives on a curvature step (gather: P or I, G; rows: its "
            f"k = {k} rows), and one Gram's memory (M x M, rows: k x k):", "",
            "| W | gather | gram-blocks | rows | Gram GiB | rows Gram GiB |", "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['W']} | " + " | ".join(_num(r[md]["recv"] / GiB) for md in ("gather", "gram-blocks", "rows"))
                   + f" | {_num(r['M'] ** 2 * 4 / GiB)} | {_num(k * k * 4 / GiB)} |")
    out += ["", "Flops of the busiest rank (curvature step TFLOP / reuse step GFLOP), Newton-Schulz GFLOP per step "
            "(owner polar's busiest rank / every matrix), modeled ms per step amortized over T:", "",
            "| W | gather | gram-blocks | rows | polar NS | ms gather | ms gram-blocks | ms auto | ms rows | ms local "
            "| fastest exact | auto: gram-blocks layers |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        fl = " | ".join(f"{_num(r[md]['curv_flops'] / TF)} / {_num(r[md]['reuse_flops'] / GF)}"
                        for md in ("gather", "gram-blocks", "rows"))
        ms = " | ".join(_num(r[md]["seconds"] * 1e3) for md in MODES)
        out.append(f"| {r['W']} | {fl} | {_num(r['polar']['flops'] / GF)} / {_num(r['polar']['total'] / GF)} | {ms} | "
                   f"{r['fastest']} | {r['auto_blocks']} / {r['layers']} |")
    out += ["", f"Per layer at W = {layer_world}: MiB one non-owner sends (curvature / reuse step), owner TFLOP "
            "(curvature step; gram-blocks: owner plus its own rows), Newton-Schulz GFLOP, auto's gram-blocks picks:",
            "",
            "| layer | n | gather | gram-blocks | rows | local | TFLOP gather | TFLOP gram-blocks | TFLOP rows | NS "
            "| auto gram-blocks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in layers:
        mib = " | ".join(_pair(g[md], MiB) for md in ("gather", "gram-blocks", "rows", "local"))
        tf = " | ".join(_num(g[md]["curv_flops"] / TF) for md in ("gather", "gram-blocks", "rows"))
        out.append(f"| {g['group']} (x{g['count']}) | {g['n']} | {mib} | {tf} | {_num(g['polar_flops'] / GF)} | "
                   f"{g['blocks']} / {g['count']} |")
    return "\n".join(out)


def plot(results: dict[str, list[dict[str, Any]]], path: str, T: int, bandwidth: float) -> str:
    """Modeled ms per step (amortized over ``T``) against ``W``, one panel per model, and
    DDP's all-reduce at ``bandwidth`` for reference; returns a line saying what was written (or why not)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed; no plot written"
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.4), squeeze=False)
    styles = {"gather": "o-", "gram-blocks": "s-", "auto": "k--", "rows": "^-", "local": "v:"}
    for ax, (name, rows) in zip(axes[0], results.items()):
        Ws = [r["W"] for r in rows]
        for md, st in styles.items():
            ax.plot(Ws, [r[md]["seconds"] * 1e3 for r in rows], st, label=md, ms=3, lw=1)
        ax.plot(Ws, [r["ddp"] / bandwidth * 1e3 for r in rows], "-", color="0.6", lw=1, label="DDP all-reduce")
        ax.set(xscale="log", yscale="log", title=SHAPES[name].label, xlabel="ranks W")
        ax.set_xticks(Ws[::2], [str(w) for w in Ws[::2]])
    axes[0][0].set_ylabel(f"modeled ms / step (T = {T})")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
    return f"plot written to {path}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.dist_scaling", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--worlds", default=",".join(str(2 ** i) for i in range(1, 11)))
    ap.add_argument("--seqs", type=int, default=8, help="sequences per rank (m)")
    ap.add_argument("--rows", type=int, default=4096, help="k of the rank-reduced rows")
    ap.add_argument("--T", type=int, default=40, help="curvature_every")
    ap.add_argument("--bandwidth", type=float, default=50e9, help="bytes/s per rank")
    ap.add_argument("--flop-rate", type=float, default=50e12, help="flop/s per rank")
    ap.add_argument("--layer-world", type=int, default=64, help="W of the per-layer tables")
    ap.add_argument("--plot", default=None, help="write the modeled time per step to this PNG")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.models.split(",") if s.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {list(SHAPES)}")
    worlds = [int(w) for w in args.worlds.split(",")]
    rates = (args.bandwidth, args.flop_rate)
    print(f"distributed TENGraD on paper: m = {args.seqs} sequences per rank, 4-byte records, T = {args.T}, "
          f"k = {args.rows} rows, {args.bandwidth / 1e9:g} GB/s, {args.flop_rate / 1e12:g} TFLOP/s per rank\n")
    results = {}
    for name in names:
        shape = SHAPES[name]
        results[name] = scaling_rows(shape, worlds, args.seqs, args.rows, args.T, *rates)
        groups = layer_rows(shape, args.layer_world, args.seqs, args.rows, args.T, *rates)
        print(report(shape, results[name], groups, args.seqs, args.rows, args.T, args.layer_world) + "\n")
    if args.plot:
        print(plot(results, args.plot, args.T, args.bandwidth))


if __name__ == "__main__":
    main()
