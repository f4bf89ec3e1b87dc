"""``python -m tools.bench --distributed N``: distributed TENGraD vs DDP-SGD on N ranks.

    python -m tools.bench --distributed 2 [--model tiny|small|3c1f] [--m 32] [--steps 6] [--warmup 2]
                          [--methods ddp-sgd,fsdp-tengrad,...] [--json out.json]

Starts ``N`` gloo processes on this machine (CPU; on a multi-GPU machine the same code
runs under NCCL through ``torchrun``, not from here), each with ``--m`` samples per rank
(global batch ``N·m``). Methods, interleaved one step each per round, every rank on its
own random batch (``--methods``: a comma list of them, default all; ``ddp-sgd`` always runs):

* ``ddp-sgd``: ``DDP(model)`` + ``torch.optim.SGD`` (the baseline);
* ``dist-tengrad``: ``DDP(prepare(model))`` + ``DistributedTENGraD`` (gather mode, each
  layer solved by its owner, ``T = 1``, empirical Fisher);
* ``dist-tengrad-replicate``: the same with ``placement="replicate"`` (every rank solves
  every layer; ``dist-tengrad`` uses ``placement="owner"``);
* ``dist-tengrad-blocks``: ``mode="gram-blocks"`` (Gram from the cross-rank blocks, the
  per-step ``J g`` / ``Jᵀ c`` data-parallel; each layer's factor on its owner);
* ``dist-tengrad-local``: ``mode="local"`` (per-rank Fisher blocks, updates averaged);
* ``dist-tengrad-T20`` / ``dist-tengrad-blocks-T20``: ``T = 20``, gather / gram-blocks;
  the reuse steps are measured (gather: only ``u`` moves; gram-blocks: the ``m``-vectors
  ``J_a g``, ``c`` and the ``Jᵀc`` partial sums);
* ``fsdp-sgd``: FSDP2 (``fully_shard`` on every Linear/conv and the root) + ``torch.optim.SGD``;
* ``fsdp-tengrad`` / ``fsdp-tengrad-blocks`` / ``fsdp-tengrad-T20``: the same model prepared
  after ``fully_shard``, ``DistributedTENGraD`` on the shards (:mod:`tengrad_fx.distributed.fsdp`),
  ``T = 1`` with ``mode="gather"`` (whole records all-gathered) / ``"gram-blocks"`` (each
  rank receives its rows' cut) / the reuse steps of ``T = 20`` (``mode="auto"``; only the
  ``[L, M]`` all-reduce of ``J_r g_r`` moves). Their
  ``DDP MB/rank`` column is FSDP's own traffic: parameters all-gathered in the forward and
  the backward and gradients reduce-scattered, ``3·(N−1)/N·n·4`` bytes per rank.

Per method: the median step time (the slowest rank's, each round), its ratio to
``ddp-sgd``, and the bytes each rank sends per step: DDP's gradient all-reduce (ring:
``2·(N−1)/N·n·4`` bytes per rank for ``n`` float32 parameters) and TENGraD's own
payload (records to owners, ``u`` from owners, counted point to point: what the rank
puts on the wire if each receiver got its own copy); the optimizer's memory per rank
(:mod:`tools.opt_memory`): its per-parameter state (momentum buffers; a DTensor's local
shard) on the largest rank, as MB and as a ratio to the whole model's parameter bytes
(about 1 under DDP, about ``1/N`` under FSDP2), and per rank the curvature kept after the
last step (records, Grams, factors; each storage once). Then, per layer, the bytes per rank
of one curvature step and one reuse step in each mode (the busiest rank's), beside the
layer's share of DDP's all-reduce, with the ratio of the totals to DDP-SGD's bytes, and
the mode ``mode="auto"`` picks for the layer (:func:`tengrad_fx.distributed.plan.choose_modes`
at ``--bandwidth`` / ``--flop-rate``); and how far the local-Fisher update is
from the global one on the first step (same parameters and batches, float64 solves:
``‖u_local − u_global‖ / ‖u_global‖``).

The same accounting on paper, per mode at ``W = 2 … 1 024`` on GPT-2 shapes (no process
group): ``python -m tools.dist_scaling``.
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import tengrad_fx
from tengrad_fx.distributed import DistributedTENGraD
from tengrad_fx.distributed.plan import assign_owners, choose_modes, solve_cost
from tengrad_fx.distributed.records import record_bytes
from tengrad_fx.zoo.bench_models import build_model
from testing.spawn import run_ranks
from tools.opt_memory import curvature_bytes, param_bytes, state_bytes

__all__ = ["METHODS", "method_list", "run_distributed", "report_distributed", "to_json"]

METHODS = ("ddp-sgd", "dist-tengrad", "dist-tengrad-replicate", "dist-tengrad-blocks", "dist-tengrad-local",
           "dist-tengrad-T20", "dist-tengrad-blocks-T20", "fsdp-sgd", "fsdp-tengrad", "fsdp-tengrad-blocks",
           "fsdp-tengrad-T20")
PER_LAYER = {"dist-tengrad": ("gather", "curvature"), "dist-tengrad-T20": ("gather", "reuse"),
             "dist-tengrad-blocks": ("gram-blocks", "curvature"), "dist-tengrad-blocks-T20": ("gram-blocks", "reuse")}


def _build_fsdp(method: str, model: torch.nn.Module, example: torch.Tensor) -> tuple[Any, Any, Any]:
    """An ``fsdp-*`` method: ``fully_shard`` on every module with parameters, then the root."""
    from torch.distributed.fsdp import fully_shard
    for mod in model.modules():
        if mod is not model and any(True for _ in mod.parameters(recurse=False)):
            fully_shard(mod)
    fully_shard(model)
    if method == "fsdp-sgd":
        return model, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-3), None
    net = tengrad_fx.prepare(model, example_inputs=(example[:2],))
    opt = DistributedTENGraD(net, lr=0.03, damping=0.03, weight_decay=1e-3, fisher="empirical", kl_clip=0.01,
                             curvature_every=20 if method.endswith("T20") else 1,
                             mode="auto" if method.endswith("T20") else "gram-blocks" if "blocks" in method else
                             "gather")
    return net, opt, net


def _build(method: str, base: torch.nn.Module, example: torch.Tensor) -> tuple[Any, Any, Any]:
    """``(forward module, optimizer, prepared model or None)``."""
    model = copy.deepcopy(base)
    if method.startswith("fsdp"):
        return _build_fsdp(method, model, example)
    if method == "ddp-sgd":
        ddp = DDP(model)
        return ddp, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-3), None
    net = tengrad_fx.prepare(model, example_inputs=(example[:2],))
    ddp = DDP(net)
    T = 20 if method.endswith("T20") else 1
    opt = DistributedTENGraD(ddp, lr=0.03, damping=0.03, weight_decay=1e-3, curvature_every=T,
                             fisher="empirical", kl_clip=0.01,
                             placement="replicate" if method.endswith("replicate") else "owner",
                             mode="local" if method.endswith("local") else
                             "gram-blocks" if "blocks" in method else "gather")
    return ddp, opt, net


def _local_error(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """``‖u_local − u_global‖ / ‖u_global‖`` of one first step from ``base`` (float64)."""
    deltas = []
    for mode in ("gather", "local"):
        net = tengrad_fx.prepare(copy.deepcopy(base).double(), example_inputs=(x[:2].double(),))
        ddp = DDP(net)
        opt = DistributedTENGraD(ddp, lr=1.0, damping=0.03, momentum=0.0, curvature_every=1, kl_clip=None,
                                 fisher="empirical", mode=mode, placement="owner")
        w0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
        F.cross_entropy(ddp(x.double()), y).backward()
        opt.step()
        deltas.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]) - w0)
    return float((deltas[1] - deltas[0]).norm() / deltas[0].norm())


def _auto_modes(opt: Any, world: int, m: int, bandwidth: float, flop_rate: float) -> dict[str, str]:
    """The mode ``mode="auto"`` picks per layer (the cost model on the captured shapes)."""
    lays = [lay for lay in opt._layers if lay.captured]
    M = world * m
    owners = assign_owners([solve_cost(M, lay.dims()) for lay in lays], world)
    ns = [sum(p.numel() for p in (lay.weight, lay.bias) if p is not None) for lay in lays]
    recs = [record_bytes(lay, M, opt.strategy) for lay in lays]
    modes = choose_modes(M, ns, [lay.dims() for lay in lays], owners, world, bandwidth, flop_rate, recs,
                         opt.curvature_every)
    return {lay.name: md for lay, md in zip(lays, modes)}


def method_list(spec: Optional[str]) -> list[str]:
    """``--methods`` of ``--distributed``: a comma list of :data:`METHODS` (None: all of
    them), in :data:`METHODS`' order, ``ddp-sgd`` (the baseline) always among them."""
    if spec is None:
        return list(METHODS)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        raise ValueError(f"--methods: unknown distributed method(s) {unknown}; choose from {list(METHODS)}")
    return [meth for meth in METHODS if meth in names or meth == "ddp-sgd"]


def _memory(runs: dict[str, tuple[Any, Any, Any]], full: int) -> dict[str, dict[str, float]]:
    """Per method: this rank's optimizer state bytes, their ratio to the whole model's
    parameter bytes ``full``, and the curvature bytes kept after the last step (:mod:`tools.opt_memory`)."""
    out = {}
    for meth, (_, opt, net) in runs.items():
        state = state_bytes(opt)
        out[meth] = {"state_bytes": state, "state_ratio": state / full, "curvature_bytes": curvature_bytes(opt, net)}
    return out


def _rank_main(rank: int, world: int, model_name: str, m: int, steps: int, warmup: int,
               bandwidth: float = 50e9, flop_rate: float = 50e12, methods: Optional[list[str]] = None,
               ) -> dict[str, Any]:
    torch.manual_seed(0)
    base, shape = build_model(model_name)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(m, *shape, generator=g), torch.randint(0, 10, (m,), generator=g)) for _ in range(3)]
    methods = methods or list(METHODS)
    runs = {meth: _build(meth, base, batches[0][0]) for meth in methods}
    n_params = sum(p.numel() for p in base.parameters())
    times: dict[str, list[float]] = {meth: [] for meth in methods}
    tg_bytes: dict[str, list[int]] = {meth: [] for meth in methods}
    per_layer: dict[tuple[str, str], dict[str, int]] = {}  # (mode, step kind) -> layer -> bytes
    for r in range(warmup + steps):
        x, y = batches[r % len(batches)]
        for meth, (fwd, opt, _) in runs.items():
            curvature = bool(getattr(opt, "_is_curvature_step", lambda: True)())
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            sent = int(sum(getattr(opt, "comm_bytes", {}).values()))
            key = PER_LAYER.get(meth)
            if key is not None and key not in per_layer and (curvature == (key[1] == "curvature")):
                per_layer[key] = dict(opt.comm_bytes)
            if r >= warmup and (not meth.endswith("T20") or not curvature):
                times[meth].append(float(dt))
                tg_bytes[meth].append(sent)
    ring = 2.0 * (world - 1) / world * n_params * 4
    local_err = _local_error(base, *batches[0])
    fsdp = 3.0 * (world - 1) / world * n_params * 4
    full = param_bytes(base)
    memory = _memory(runs, full)
    res = {meth: {"step_s": statistics.median(times[meth]), "ddp_bytes": fsdp if meth.startswith("fsdp") else ring,
                  "tengrad_bytes": statistics.median(tg_bytes[meth]) if tg_bytes[meth] else 0.0, **memory[meth]}
           for meth in methods}
    ddp_tengrad = [runs[meth][1] for meth in methods if meth.startswith("dist-")]
    layer_n: dict[str, int] = {}
    auto: dict[str, str] = {}
    if ddp_tengrad:  # the per-layer table: any DDP TENGraD's layers
        layer_n = {lay.name: sum(p.numel() for p in (lay.weight, lay.bias) if p is not None)
                   for lay in ddp_tengrad[0]._layers}
    if "dist-tengrad-blocks" in runs:  # the auto pick needs every layer's records on this rank
        auto = _auto_modes(runs["dist-tengrad-blocks"][1], world, m, bandwidth, flop_rate)
    return {"rank": rank, "results": res, "per_layer": per_layer, "n_params": n_params, "param_bytes": full,
            "local_error": local_err, "layer_n": layer_n, "auto": auto, "rates": (bandwidth, flop_rate)}


def run_distributed(world: int, model: str = "tiny", m: int = 32, steps: int = 6, warmup: int = 2,
                    threads: int = 1, bandwidth: float = 50e9, flop_rate: float = 50e12,
                    methods: Optional[str] = None) -> list[dict[str, Any]]:
    """Every rank's results (:func:`_rank_main`) from ``world`` spawned gloo ranks
    (``methods``: a comma list, :func:`method_list`)."""
    meths = method_list(methods)
    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_rank_main, world, Path(d), model, m, steps, warmup, bandwidth, flop_rate, meths,
                         timeout=3600.0, pg_timeout=600.0, threads=threads)


def to_json(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' results with JSON keys: ``per_layer``'s ``(mode, step kind)`` as ``"mode/kind"``."""
    return [{**rk, "per_layer": {"/".join(k): v for k, v in rk["per_layer"].items()}} for rk in ranks]


def report_distributed(ranks: list[dict[str, Any]], world: int, model: str, m: int) -> str:
    """The printed table (module docstring)."""
    res = ranks[0]["results"]
    sgd = res["ddp-sgd"]["step_s"]

    def per_rank(meth: str, key: str) -> str:
        return " ".join(f"{rk['results'][meth][key] / 2**20:.3f}" for rk in ranks)

    wt = max(24, *(len(per_rank(meth, "tengrad_bytes")) for meth in res))
    wc = max(26, *(len(per_rank(meth, "curvature_bytes")) for meth in res))
    lines = [f"distributed bench: {world} gloo ranks (CPU), model {model}, m = {m} per rank "
             f"(global {world * m}), {ranks[0]['n_params']} parameters",
             f"{'method':24s} {'step ms':>9s} {'x DDP-SGD':>10s} {'DDP MB/rank':>12s} "
             f"{'TENGraD MB/rank (r0..)':>{wt}s} {'state MB/rank':>14s} {'x params':>9s} "
             f"{'curvature MB/rank (r0..)':>{wc}s}"]
    for meth, r in res.items():
        state = max(rk["results"][meth]["state_bytes"] for rk in ranks)
        note = " (reuse steps)" if meth.endswith("T20") else ""
        lines.append(f"{meth:24s} {r['step_s'] * 1e3:9.1f} {r['step_s'] / sgd:10.2f} "
                     f"{r['ddp_bytes'] / 2**20:12.3f} {per_rank(meth, 'tengrad_bytes'):>{wt}s} {state / 2**20:14.3f} "
                     f"{state / ranks[0]['param_bytes']:9.3f} {per_rank(meth, 'curvature_bytes'):>{wc}s}{note}")
    lines.append(f"state: the optimizer's per-parameter tensors on the largest rank (x params: over the whole "
                 f"model's {ranks[0]['param_bytes'] / 2**20:.3f} MB of parameters); curvature: records, Grams and "
                 f"factors kept after the last step")
    lines += _per_layer_table(ranks, world)
    lines.append(f"local-Fisher update vs the global-batch one (first step, float64): relative difference "
                 f"{ranks[0]['local_error']:.3g}")
    return "\n".join(lines)


def _per_layer_table(ranks: list[dict[str, Any]], world: int) -> list[str]:
    """Per layer: KB sent per rank (the busiest rank) on a curvature and a reuse step in
    each mode, its share of DDP's all-reduce, the ``auto`` pick; totals and × DDP-SGD."""
    cols = [("gather", "curvature"), ("gather", "reuse"), ("gram-blocks", "curvature"), ("gram-blocks", "reuse")]
    layer_n = ranks[0]["layer_n"]
    names = [n for n in layer_n if any(n in rk["per_layer"].get(c, {}) for rk in ranks for c in cols)]
    if not names:
        return []
    bw, fr = ranks[0]["rates"]
    ring = 2.0 * (world - 1) / world * 4
    lines = [f"TENGraD bytes per rank per step by layer and mode (KB, busiest rank; DDP: the layer's share of "
             f"DDP-SGD's all-reduce; auto: mode='auto' at {bw / 1e9:g} GB/s, {fr / 1e12:g} TFLOP/s):",
             f"  {'layer':20s} {'DDP':>9s} {'gather curv':>12s} {'gather reuse':>13s} {'blocks curv':>12s} "
             f"{'blocks reuse':>13s}  auto"]
    measured = [True] + [any(c in rk["per_layer"] for rk in ranks) for c in cols]  # "-": a method not run

    def row(label: str, vals: list[float], scale: float, digits: int) -> str:
        return f"  {label:20s} " + " ".join(f"{v / scale:{w}.{digits}f}" if ok else f"{'-':>{w}s}"
                                             for v, w, ok in zip(vals, (9, 12, 13, 12, 13), measured))

    totals = [0.0] * (len(cols) + 1)
    for n in names:
        vals = [ring * layer_n[n]] + [max(rk["per_layer"].get(c, {}).get(n, 0) for rk in ranks) for c in cols]
        totals = [t + v for t, v in zip(totals, vals)]
        lines.append(row(n, vals, 1024, 1) + f"  {ranks[0]['auto'].get(n, '-')}")
    lines.append(row("total", totals, 1024, 1))
    lines.append(row("x DDP-SGD", totals, totals[0] or 1.0, 2))
    return lines
