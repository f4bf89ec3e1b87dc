"""Checkpoint round trips of the option matrix (``tests/distributed/test_matrix.py``):
a run of :data:`~testing.matrix_workers.STEPS` steps, and the same run saved after
:data:`CUT` steps and continued by a new model and optimizer loaded from the save.

Under DDP the optimizer's own ``state_dict`` (rank 0's ``torch.save`` file, which every rank
loads); under FSDP2 a ``torch.distributed.checkpoint`` directory (``get_state_dict`` /
``set_state_dict``, :func:`testing.fsdp_workers.save_checkpoint`). A spawn of another world
size loads either (:func:`resumed_ranks`; FSDP2 resharded). The cut falls before a curvature step
(``curvature_every=2``): the resumed optimizer's next step takes curvature as the
uninterrupted one's does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import fsdp_workers
from .matrix_workers import STEPS, built, per_job, train

__all__ = ["CUT", "round_trip_ranks", "resumed_ranks"]

CUT = 2


def _save(strategy: str, opt: Any, net: torch.nn.Module, where: Path) -> Path:
    """The model's and optimizer's state saved at ``where``: a DCP directory (FSDP2), or
    rank 0's ``torch.save`` file (DDP; written before any rank goes on)."""
    if strategy.startswith("ddp"):
        if dist.get_rank() == 0:
            where.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, where)
        dist.barrier()
        return where
    fsdp_workers.save_checkpoint(net, opt, str(where))
    return where


def _load(strategy: str, opt: Any, net: torch.nn.Module, saved: Path) -> None:
    if strategy.startswith("ddp"):
        state = torch.load(saved, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    else:
        fsdp_workers.load_checkpoint(net, opt, str(saved))


def round_trip_ranks(rank: int, world: int, strategies: list[str], jobs: dict[str, tuple[str, dict[str, Any]]],
                     root: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Per strategy and job ``name -> (model, case)``: ``{"full": ..., "resumed": ...}``
    (:func:`train`'s results of the uninterrupted run and of the saved-and-loaded one's last
    steps; the save in ``root/strategy/name``), or ``{"construction": message}`` where the
    case is refused."""
    return {strategy: _round_trips(rank, world, strategy, jobs, Path(root) / strategy) for strategy in strategies}


def _round_trips(rank: int, world: int, strategy: str, jobs: dict[str, tuple[str, dict[str, Any]]],
                 root: Path) -> dict[str, dict[str, Any]]:
    part = (rank, world)

    def run(name: str, kind: str, case: dict[str, Any], made: tuple[Any, torch.nn.Module, torch.nn.Module]
            ) -> dict[str, Any]:
        full = train(*made, kind, part)
        opt, fwd, net = built(kind, strategy, world, case)
        train(opt, fwd, net, kind, part, steps=range(CUT))
        saved = _save(strategy, opt, net, root / name)
        opt, fwd, net = built(kind, strategy, world, case)
        _load(strategy, opt, net, saved)
        return {"full": full, "resumed": train(opt, fwd, net, kind, part, steps=range(CUT, STEPS))}
    return per_job(world, strategy, jobs, run)


def resumed_ranks(rank: int, world: int, plan: dict[str, dict[str, tuple[str, dict[str, Any]]]],
                  root: str) -> dict[str, dict[str, dict[str, Any]]]:
    """Per strategy of ``plan`` (strategy -> jobs) and job: the last steps of a new model and
    optimizer on ``world`` ranks loaded from the save ``root/strategy/name`` that
    :func:`round_trip_ranks` wrote on another world size."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for strategy, jobs in plan.items():
        out[strategy] = {}
        for name, (kind, case) in jobs.items():
            opt, fwd, net = built(kind, strategy, world, case)
            _load(strategy, opt, net, Path(root) / strategy / name)
            out[strategy][name] = {"resumed": train(opt, fwd, net, kind, (rank, world), steps=range(CUT, STEPS))}
    return out
