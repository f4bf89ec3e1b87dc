"""``python -m tools.bench --distributed N``: distributed TENGraD vs DDP-SGD on N ranks.

    python -m tools.bench --distributed 2 [--model tiny|small|3c1f] [--m 32] [--steps 6] [--warmup 2]

Starts ``N`` gloo processes on this machine (CPU; on a multi-GPU machine the same code
runs under NCCL through ``torchrun``, not from here), each with ``--m`` samples per rank
(global batch ``N·m``). Methods, interleaved one step each per round, every rank on its
own random batch:

* ``ddp-sgd``: ``DDP(model)`` + ``torch.optim.SGD`` (the baseline);
* ``dist-tengrad``: ``DDP(prepare(model))`` + ``DistributedTENGraD`` (gather mode, each
  layer solved by its owner, ``T = 1``, empirical Fisher);
* ``dist-tengrad-replicate``: the same with ``placement="replicate"`` (every rank solves
  every layer; ``dist-tengrad`` uses ``placement="owner"``);
* ``dist-tengrad-local``: ``mode="local"`` (per-rank Fisher blocks, updates averaged);
* ``dist-tengrad-T20``: ``T = 20``; the reuse steps are measured (only ``u`` moves).

Per method: the median step time (the slowest rank's, each round), its ratio to
``ddp-sgd``, and the bytes each rank sends per step: DDP's gradient all-reduce (ring:
``2·(N−1)/N·n·4`` bytes per rank for ``n`` float32 parameters) and TENGraD's own
payload (records to owners, ``u`` from owners, counted point to point: what the rank
puts on the wire if each receiver got its own copy). Then the per-layer TENGraD bytes of
one curvature step and one reuse step, per rank; and how far the local-Fisher update is
from the global one on the first step (same parameters and batches, float64 solves:
``‖u_local − u_global‖ / ‖u_global‖``).
"""
from __future__ import annotations

import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["run_distributed", "report_distributed"]

METHODS = ("ddp-sgd", "dist-tengrad", "dist-tengrad-replicate", "dist-tengrad-local", "dist-tengrad-T20")


def _build(method: str, base: torch.nn.Module, example: torch.Tensor) -> tuple[Any, Any, Any]:
    """``(forward module, optimizer, prepared model or None)``."""
    import tengrad_fx  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415
    from tengrad_fx.distributed import DistributedTENGraD  # noqa: PLC0415

    model = copy.deepcopy(base)
    if method == "ddp-sgd":
        ddp = DDP(model)
        return ddp, torch.optim.SGD(model.parameters(), lr=0.03, momentum=0.9, weight_decay=1e-3), None
    net = tengrad_fx.prepare(model, example_inputs=(example[:2],))
    ddp = DDP(net)
    T = 20 if method.endswith("T20") else 1
    opt = DistributedTENGraD(ddp, lr=0.03, damping=0.03, weight_decay=1e-3, curvature_every=T,
                             fisher="empirical", kl_clip=0.01,
                             placement="replicate" if method.endswith("replicate") else "owner",
                             mode="local" if method.endswith("local") else "gather")
    return ddp, opt, net


def _local_error(base: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """``‖u_local − u_global‖ / ‖u_global‖`` of one first step from ``base`` (float64)."""
    import tengrad_fx  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415
    from tengrad_fx.distributed import DistributedTENGraD  # noqa: PLC0415

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


def _rank_main(rank: int, world: int, model_name: str, m: int, steps: int, warmup: int) -> dict[str, Any]:
    from tools.bench import build_model  # noqa: PLC0415

    torch.manual_seed(0)
    base, shape = build_model(model_name)
    g = torch.Generator().manual_seed(100 + rank)
    batches = [(torch.randn(m, *shape, generator=g), torch.randint(0, 10, (m,), generator=g)) for _ in range(3)]
    runs = {meth: _build(meth, base, batches[0][0]) for meth in METHODS}
    n_params = sum(p.numel() for p in base.parameters())
    times: dict[str, list[float]] = {meth: [] for meth in METHODS}
    tg_bytes: dict[str, list[int]] = {meth: [] for meth in METHODS}
    per_layer: dict[str, dict[str, int]] = {}
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
            if meth == "dist-tengrad" and r == warmup:
                per_layer["curvature"] = dict(opt.comm_bytes)
            if meth == "dist-tengrad-T20" and not curvature and "reuse" not in per_layer:
                per_layer["reuse"] = dict(opt.comm_bytes)
            if r >= warmup and (not meth.endswith("T20") or not curvature):
                times[meth].append(float(dt))
                tg_bytes[meth].append(sent)
    ring = 2.0 * (world - 1) / world * n_params * 4
    local_err = _local_error(base, *batches[0])
    res = {meth: {"step_s": statistics.median(times[meth]), "ddp_bytes": ring,
                  "tengrad_bytes": statistics.median(tg_bytes[meth]) if tg_bytes[meth] else 0.0}
           for meth in METHODS}
    return {"rank": rank, "results": res, "per_layer": per_layer, "n_params": n_params, "local_error": local_err}


def run_distributed(world: int, model: str = "tiny", m: int = 32, steps: int = 6, warmup: int = 2,
                    threads: int = 1) -> list[dict[str, Any]]:
    """Every rank's results (:func:`_rank_main`) from ``world`` spawned gloo ranks."""
    from tools._spawn import run_ranks  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as d:
        return run_ranks(_rank_main, world, Path(d), model, m, steps, warmup, timeout=3600.0,
                         pg_timeout=600.0, threads=threads)


def report_distributed(ranks: list[dict[str, Any]], world: int, model: str, m: int) -> str:
    """The printed table (module docstring)."""
    res = ranks[0]["results"]
    sgd = res["ddp-sgd"]["step_s"]
    lines = [f"distributed bench: {world} gloo ranks (CPU), model {model}, m = {m} per rank "
             f"(global {world * m}), {ranks[0]['n_params']} parameters",
             f"{'method':24s} {'step ms':>9s} {'x DDP-SGD':>10s} {'DDP MB/rank':>12s} {'TENGraD MB/rank (r0..)':>24s}"]
    for meth, r in res.items():
        tg = " ".join(f"{rk['results'][meth]['tengrad_bytes'] / 2**20:.3f}" for rk in ranks)
        note = " (reuse steps)" if meth.endswith("T20") else ""
        lines.append(f"{meth:24s} {r['step_s'] * 1e3:9.1f} {r['step_s'] / sgd:10.2f} "
                     f"{r['ddp_bytes'] / 2**20:12.3f} {tg:>24s}{note}")
    for kind in ("curvature", "reuse"):
        names = sorted({n for rk in ranks for n in rk["per_layer"].get(kind, {})})
        if not names:
            continue
        lines.append(f"TENGraD bytes sent per rank, {kind} step, by layer (KB, ranks 0..{world - 1}):")
        for n in names:
            vals = " ".join(f"{rk['per_layer'].get(kind, {}).get(n, 0) / 1024:9.1f}" for rk in ranks)
            lines.append(f"  {n:20s} {vals}")
    lines.append(f"local-Fisher update vs the global-batch one (first step, float64): relative difference "
                 f"{ranks[0]['local_error']:.3g}")
    return "\n".join(lines)
