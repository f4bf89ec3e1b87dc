"""Analytic communication / flop model of distributed TENGraD (docs/distributed.md).

    python -m tools.dist_model [--model wrn-28-4|vit-b16|3c1f] [--worlds 8,64,512] [--m 128] [--T 100]

Per covered layer the shapes come from one captured forward/backward at batch 2 (CPU):
``r`` = record elements per sample (``I`` and ``G``, or ``P`` where a kind always keeps
per-sample gradients), ``n`` = parameters, ``(g, S, f, o)`` the Gram cost dims. With
``W`` ranks, ``m`` samples per rank and ``M = W·m`` (4-byte floats):

* the mode per layer is what ``mode="auto"`` picks (:func:`tengrad_fx.distributed.plan.choose_modes`
  at the stated bandwidth and flop rate; ``blocks`` counts the ``gram-blocks`` layers);
* curvature step, either mode: a non-owner sends ``m·r·4`` bytes of the layer's records
  to its owner (the owner receives ``(W−1)`` times that);
* gather, every step: the owner broadcasts ``u`` (``n·4`` bytes; a pipelined/ring
  broadcast has every rank send them once) and computes ``J g``, ``Jᵀc`` on ``M`` rows;
* gram-blocks, every step: all-gather of ``J_a g`` (``(W−1)·m·4`` bytes sent per rank),
  broadcast of ``c`` (``M·4``), ring all-reduce of the ``Jᵀc`` partial sums
  (``2(W−1)/W·n·4``); ``J g``, ``Jᵀc`` on the rank's own ``m`` rows;
* replicate: every rank all-gathers the records (``(W−1)·m·r·4`` bytes sent per rank on a
  curvature step) and sends nothing on reuse steps;
* per-rank local Fisher (``mode="local"``): an ``m × m`` Gram per rank, one all-reduce of
  the ``u`` (``2·(W−1)/W·n·4`` bytes per rank per step), no records moved;
* owner flops per curvature step: Gram ``min(2M²S²(f+o)g, 2MSfog + 2M²fog)`` + Cholesky
  ``M³/3``; memory of one Gram ``M²·4`` bytes; ``step GFLOP``: the busiest rank's ``J g``
  and ``Jᵀc`` flops per step (``4·M·S·f·o·g`` per gather layer it owns, ``4·m·S·f·o·g``
  per gram-blocks layer);
* DDP's gradient all-reduce (any optimizer): ``2·(W−1)/W·N·4`` bytes per rank per step.

``curv MB`` counts a gather layer's per-sample gradients ``P`` (``n`` per sample) where
the ranks send them instead of ``I``, ``G`` (:func:`tengrad_fx.distributed.records.sends_per_sample`:
a Linear or convolution called once, ``n < r``, and the owner materializes at ``M``);
``I,G MB`` is the same with every layer's records sent as ``I``, ``G``. The table reports, per
world size, the totals per rank (maximum over ranks, owners by the greedy assignment of
:mod:`tengrad_fx.distributed.plan`), the per-layer mode and the placement that
the ``placement="auto"`` rule of :func:`tengrad_fx.distributed.plan.choose_placement`
picks at the stated bandwidth and flop rate, and whether the global Gram is affordable
(every owner's Gram memory ≤ 8 GiB and curvature-step flops ≤ 100 TFLOP, i.e. about 2 s
at 50 TFLOP/s, once per ``T`` steps).
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.distributed.plan import assign_owners, choose_modes, choose_placement, solve_cost, step_flops
from tengrad_fx.distributed.records import per_sample_smaller
from tengrad_fx.distributed.traffic import (all_gather_sent, all_reduce_sent, blocks_step_sent, broadcast_sent,
                                            gather_sent, gather_step_sent)
from tengrad_fx.zoo import get_model
from tengrad_fx.zoo.bench_models import build_model

__all__ = ["layer_shapes", "model_table", "main"]

GRAM_MEMORY_LIMIT = 8 * 2**30
CURVATURE_FLOP_LIMIT = 100e12


def _build(name: str) -> tuple[torch.nn.Module, tuple[int, ...], int]:
    if name == "vit-b16":
        import timm

        return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000), (3, 224, 224), 1000
    if name == "3c1f":
        model, shape = build_model("3c1f")
        return model, shape, 10
    return get_model(name, num_classes=10), (3, 32, 32), 10


def layer_shapes(name: str) -> list[dict[str, Any]]:
    """Per covered layer: ``name``, ``n``, ``r`` (record elements per sample), ``dims``,
    ``p_ok`` (a Linear or convolution called once: its ``P`` may be sent instead)."""
    model, shape, classes = _build(name)
    x = torch.randn(2, *shape)
    net = tengrad_fx.prepare(model, example_inputs=(x,))
    F.cross_entropy(net(x), torch.zeros(2, dtype=torch.long)).backward()
    out = []
    for lay in tengrad_fx.covered_layers(net):
        if not lay.captured:
            continue
        r = sum(t.numel() for rec in lay.records() for t in (rec.I, rec.G, rec.P, rec.Gsum)
                if t is not None and t.is_floating_point()) // 2
        p_ok = (lay.kind == "linear" or lay.kind.startswith("conv")) and len(lay.records()) == 1
        n = sum(p.numel() for p in (lay.weight, lay.bias) if p is not None)
        out.append({"name": lay.name, "n": n, "r": r, "dims": lay.dims(), "p_ok": p_ok})
    return out


def model_table(layers: list[dict[str, Any]], worlds: list[int], m: int, T: int,
                bandwidth: float, flop_rate: float) -> list[dict[str, Any]]:
    """One row per world size (module docstring)."""
    N = sum(lay["n"] for lay in layers)
    rows = []
    for W in worlds:
        M = W * m
        costs = [solve_cost(M, lay["dims"]) for lay in layers]
        owners = assign_owners(costs, W)
        p_sent = [lay.get("p_ok", False) and per_sample_smaller(lay["n"], m, m * lay["r"], M, lay["dims"], "auto")
                  for lay in layers]  # records.sends_per_sample, in gather mode
        recs = [(m * (lay["n"] if p else lay["r"]) * 4.0, m * lay["r"] * 4.0) for lay, p in zip(layers, p_sent)]
        modes = choose_modes(M, [lay["n"] for lay in layers], [lay["dims"] for lay in layers], owners, W,
                             bandwidth, flop_rate, recs, T)
        place = [choose_placement(M, lay["n"], m * lay["r"] * 4, lay["dims"], W, T, bandwidth, flop_rate, md)
                 for lay, md in zip(layers, modes)]
        gather_curv = [0.0] * W
        all_ig = [0.0] * W  # the same with every layer's records sent as I, G
        reuse = [0.0] * W
        flops = [0.0] * W
        step = [0.0] * W  # per-step J g and Jᵀc flops
        for lay, o, pl, c, md, p in zip(layers, owners, place, costs, modes, p_sent):
            blocks = md == "gram-blocks"
            send_p = p and not blocks
            rec = m * (lay["n"] if send_p else lay["r"]) * 4.0
            ig = m * lay["r"] * 4.0
            if blocks:  # every rank: the Jᵀc all-reduce and J_a g all-gather; c from the owner
                vec = blocks_step_sent(m, W, lay["n"]) - (broadcast_sent(M * 4.0) if pl == "replicate" else 0.0)
                for k in range(W):
                    reuse[k] += vec
                    step[k] += step_flops(m, lay["dims"])
            if pl == "replicate":
                for k in range(W):
                    gather_curv[k] += all_gather_sent(rec, W)
                    all_ig[k] += all_gather_sent(ig, W)
                    flops[k] += c
                    step[k] += 0.0 if blocks else step_flops(M, lay["dims"])
            else:
                for k in range(W):
                    gather_curv[k] += gather_sent(rec, k == o)
                    all_ig[k] += gather_sent(ig, k == o)
                    reuse[k] += 0.0 if blocks else gather_step_sent(lay["n"])
                flops[o] += c
                step[o] += 0.0 if blocks else step_flops(M, lay["dims"])
        gram_mem = M * M * 4.0
        rows.append({
            "W": W, "M": M, "ddp_MB": all_reduce_sent(N * 4, W) / 2**20,
            "curv_MB": max(gather_curv) / 2**20, "curvIG_MB": max(all_ig) / 2**20, "reuse_MB": max(reuse) / 2**20,
            "local_MB": all_reduce_sent(N * 4, W) / 2**20,
            "owner_TFLOP": max(flops) / 1e12, "gram_GiB": gram_mem / 2**30,
            "replicated": sum(p == "replicate" for p in place), "layers": len(layers),
            "blocks": sum(md == "gram-blocks" for md in modes), "modes": modes, "step_GFLOP": max(step) / 1e9,
            "affordable": gram_mem <= GRAM_MEMORY_LIMIT and max(flops) <= CURVATURE_FLOP_LIMIT,
            "placement": place,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.dist_model", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="wrn-28-4")
    ap.add_argument("--worlds", default="8,64,512")
    ap.add_argument("--m", type=int, default=128, help="samples per rank")
    ap.add_argument("--T", type=int, default=100, help="curvature period")
    ap.add_argument("--bandwidth", type=float, default=50e9, help="bytes/s per rank (NCCL, NVLink/IB class)")
    ap.add_argument("--flop-rate", type=float, default=50e12, help="flop/s per GPU")
    ap.add_argument("--layers", action="store_true", help="also print every layer's placement per world size")
    args = ap.parse_args(argv)
    layers = layer_shapes(args.model)
    rows = model_table(layers, [int(w) for w in args.worlds.split(",")], args.m, args.T, args.bandwidth,
                       args.flop_rate)
    N = sum(lay["n"] for lay in layers)
    print(f"{args.model}: {len(layers)} covered layers, {N / 1e6:.1f} M covered parameters, m = {args.m} per rank, "
          f"T = {args.T}; bandwidth {args.bandwidth / 1e9:g} GB/s, {args.flop_rate / 1e12:g} TFLOP/s")
    print(f"{'W':>5s} {'M':>7s} {'DDP MB':>8s} {'curv MB':>9s} {'I,G MB':>9s} {'reuse MB':>9s} {'local MB':>9s} "
          f"{'owner TFLOP':>12s} {'step GFLOP':>11s} {'Gram GiB':>9s} {'blocks':>11s} {'replicated':>11s} global Gram")
    for r in rows:
        print(f"{r['W']:5d} {r['M']:7d} {r['ddp_MB']:8.1f} {r['curv_MB']:9.1f} {r['curvIG_MB']:9.1f} "
              f"{r['reuse_MB']:9.1f} {r['local_MB']:9.1f} {r['owner_TFLOP']:12.3f} {r['step_GFLOP']:11.1f} "
              f"{r['gram_GiB']:9.3f} "
              f"{r['blocks']:>5d}/{r['layers']:<5d} {r['replicated']:>5d}/{r['layers']:<5d} "
              f"{'affordable' if r['affordable'] else 'NOT affordable: local'}")
    if args.layers:
        print(f"{'layer':40s} {'n':>10s} {'r/sample':>10s} " + " ".join(f"{'W=' + str(r['W']):>20s}" for r in rows))
        for i, lay in enumerate(layers):
            print(f"{lay['name'][:40]:40s} {lay['n']:10d} {lay['r']:10d} "
                  + " ".join(f"{r['modes'][i] + '/' + r['placement'][i]:>20s}" for r in rows))


if __name__ == "__main__":
    main()
