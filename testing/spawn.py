"""Run a function on ``W`` gloo ranks (one process each, spawned) on this machine: what
``python -m tools.bench --distributed N`` and the distributed tests use.

:func:`run_ranks` starts ``W`` processes (the ``spawn`` start method: each imports what
the parent can, from the parent's ``sys.path``), each joins a gloo process group on a
free local port with a short timeout, runs ``fn(rank, world, *args)`` and writes its
result (``torch.save``) or its traceback to ``out_dir``. The parent waits at most
``timeout`` seconds in all, kills what is left (no hang), and returns the per-rank
results, or raises with every failed rank's traceback (``RanksFailed``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from tengrad_fx.distributed.process_exit import exit_without_teardown

__all__ = ["free_port", "run_ranks", "RanksFailed"]


class RanksFailed(RuntimeError):
    """Some ranks raised (``errors``: rank -> traceback text) or had to be killed."""

    def __init__(self, msg: str, errors: dict[int, str]):
        super().__init__(msg)
        self.errors = errors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, pg_timeout: float,
           out_dir: str, threads: int, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    out = Path(out_dir)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
        try:
            result = fn(rank, world, *args)
            torch.save(result, out / f"rank{rank}.pt")
            dist.barrier()  # no rank tears its process group down while another still talks to it
        finally:
            dist.destroy_process_group()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        exit_without_teardown(1)
    exit_without_teardown(0)  # the result written, the process group destroyed


def run_ranks(fn: Callable[..., Any], world: int, out_dir: Path, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 30.0, threads: int = 1) -> list[Any]:
    """``[fn(0, world, *args), ..., fn(world-1, world, *args)]`` from ``world`` gloo ranks
    (``fn`` importable by name; ``threads`` torch threads per rank)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, pg_timeout, str(out_dir), threads, args), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    killed = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in killed:
        procs[r].kill()
        procs[r].join()
    errors = {r: (out_dir / f"rank{r}.err").read_text() for r in range(world) if (out_dir / f"rank{r}.err").exists()}
    for r in killed:
        errors.setdefault(r, f"rank {r} still running after {timeout} s: killed")
    for r, p in enumerate(procs):
        if r not in errors and (p.exitcode != 0 or not (out_dir / f"rank{r}.pt").exists()):
            errors[r] = f"rank {r} exited with code {p.exitcode} and no result"
    if errors:
        text = "\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(errors.items()))
        raise RanksFailed(f"{len(errors)} of {world} ranks failed:\n{text}", errors)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
