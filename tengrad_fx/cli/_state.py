"""The state of one ``tengrad_fx.cli.train`` run (:class:`RunState`) and how a run is opened:
the ``--resume`` checkpoint, the data, the model and optimizer, the files of ``--out``.

:func:`open_run` builds the state (fresh or restored from the checkpoint) and prepares
the output directory; :meth:`RunState.snapshot` is what a checkpoint holds, and
:meth:`RunState.restore` puts it back. The loop itself is ``tengrad_fx.cli._loop``.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.nn as nn

from .. import zoo
from ._checkpoint import CHECKPOINT, CheckpointError, load_for_resume, remove_stale
from ._logs import JsonlLog, StepBuffer, truncate_jsonl

__all__ = ["LOG_NAMES", "TRAJECTORY_KEYS", "Logs", "RunState", "Setup", "open_run"]

# Arguments that determine the trajectory: --resume refuses a checkpoint whose config differs.
TRAJECTORY_KEYS = ("model", "dataset", "optimizer", "batch_size", "lr", "momentum", "weight_decay", "damping",
                   "curvature_every", "fisher", "kl_clip", "lr_schedule", "seed", "subset")

LOG_NAMES = ("steps.jsonl", "evals.jsonl", "epochs.jsonl")

# train_ds -> (model, optimizer, coverage report or None, extra config.json entries)
Setup = Callable[[Any], "tuple[nn.Module, torch.optim.Optimizer, Optional[str], dict[str, Any]]"]


@dataclass
class Logs:
    """The jsonl logs of a run (``evals`` only with ``--eval-every``)."""

    steps: JsonlLog
    epochs: JsonlLog
    evals: Optional[JsonlLog]

    def close(self) -> None:
        for log in (self.steps, self.epochs, self.evals):
            if log is not None:
                log.close()


@dataclass
class RunState:
    """Everything a training run carries from step to step.

    Built once by :func:`open_run`; the loop's functions read and advance it. Position:
    ``epoch`` (0-based, epochs completed), ``step`` (global steps done), ``batch_in_epoch``;
    clocks: ``train_time`` / ``eval_time`` (cumulative seconds); the current epoch's running
    sums ``ep_loss_sum`` / ``ep_loss_n`` (finite losses only) / ``ep_correct`` / ``ep_count``;
    ``epoch_gen_state``: the data generator's state at the start of the current epoch.
    """

    cfg: dict[str, Any]
    out: Path
    device: torch.device
    dist: Any  # tengrad_fx.cli._dist.DistRun or None
    model: nn.Module
    opt: torch.optim.Optimizer
    forward: Callable[[torch.Tensor], torch.Tensor]  # the model, compiled or DDP-wrapped
    train_ds: Any
    test_ds: Any
    gen: torch.Generator  # data order (+ augmentation), always on the CPU
    steps_per_epoch: int
    epoch_gen_state: torch.Tensor
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    train_time: float = 0.0
    eval_time: float = 0.0
    compile_time: Optional[float] = None
    skipped_loss: int = 0  # steps skipped for a non-finite loss
    ep_loss_sum: float = 0.0
    ep_loss_n: float = 0.0
    ep_correct: float = 0.0
    ep_count: float = 0.0
    samples: int = 0
    session_samples: int = 0  # samples and the train_time at the start of this process's part
    session_t0: float = 0.0
    resumed_at: list[int] = field(default_factory=list)
    last_eval: Optional[dict[str, Any]] = None
    stopped: bool = False  # --max-steps stopped the run inside the epoch loop
    buffer: StepBuffer = field(default_factory=StepBuffer)
    bar: Any = None
    logs: Optional[Logs] = None
    show: bool = False  # progress bars

    @property
    def main(self) -> bool:
        """The process that writes files and prints (rank 0, or the only one)."""
        return self.dist is None or self.dist.main

    @property
    def device_skips(self) -> bool:
        """The optimizer skips non-finite steps on the device (``SYNC_FREE``), not distributed."""
        return self.dist is None and bool(getattr(self.opt, "SYNC_FREE", False))

    @property
    def resolved(self) -> dict[str, Any]:
        """The configuration as checkpoints store it (without ``resume``)."""
        return {k: v for k, v in self.cfg.items() if k != "resume"}

    def at_max_steps(self) -> bool:
        return self.cfg["max_steps"] is not None and self.step >= self.cfg["max_steps"]

    def reset_epoch_sums(self) -> None:
        self.ep_loss_sum = self.ep_loss_n = self.ep_correct = self.ep_count = 0.0

    def snapshot(self) -> dict[str, Any]:
        """The checkpoint: model, optimizer, position, clocks, counts, RNG states, config."""
        cuda = self.device.type == "cuda"
        return {
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "train_time": self.train_time,
            "eval_time": self.eval_time,
            "skipped_nonfinite_loss": self.skipped_loss,
            "epoch_sums": (self.ep_loss_sum, self.ep_loss_n, self.ep_correct, self.ep_count),
            "samples": self.samples,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(self.device) if cuda else None,
                    "data_epoch_start": self.epoch_gen_state},
            "config": self.resolved,
            "resumed_at": self.resumed_at,
        }

    def restore(self, ckpt: dict[str, Any]) -> None:
        """Put a :meth:`snapshot` back (model, optimizer, position, RNG states)."""
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.epoch, self.step, self.batch_in_epoch = ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"]
        self.train_time, self.eval_time = ckpt["train_time"], ckpt["eval_time"]
        self.skipped_loss = ckpt["skipped_nonfinite_loss"]
        self.ep_loss_sum, self.ep_loss_n, self.ep_correct, self.ep_count = ckpt["epoch_sums"]
        self.samples = ckpt["samples"]
        self.epoch_gen_state = ckpt["rng"]["data_epoch_start"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        if self.device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], self.device)
        self.resumed_at = list(ckpt.get("resumed_at", [])) + [self.step]


def open_run(cfg: dict[str, Any], setup: Setup, error: Callable[[str], NoReturn], dist: Any) -> RunState:
    """The run's state, fresh or from ``--out``'s checkpoint (``--resume``), with the output
    directory prepared (logs cut back or removed, ``config.json``, ``coverage.txt``) and
    the logs open. A configuration that differs from the checkpoint's fails first."""
    device = torch.device(dist.device if dist is not None else cfg["device"])
    out = Path(cfg["out"])
    ckpt = _resume_checkpoint(cfg, out, error)
    train_ds, test_ds = _datasets(cfg, device, error)
    torch.manual_seed(cfg["seed"])
    model, opt, coverage, extra_meta = setup(train_ds)
    forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if cfg["compile"] else model
    if dist is not None:
        forward = dist.wrap(model)
    out.mkdir(parents=True, exist_ok=True)  # only now: a bad --model/--dataset leaves no directory behind
    gen = torch.Generator().manual_seed(cfg["seed"])
    steps_per_epoch = zoo.num_batches(train_ds, cfg["batch_size"]) if dist is None else \
        len(train_ds) // cfg["batch_size"]  # distributed: the last incomplete global batch is dropped
    st = RunState(cfg=cfg, out=out, device=device, dist=dist, model=model, opt=opt, forward=forward,
                  train_ds=train_ds, test_ds=test_ds, gen=gen, steps_per_epoch=steps_per_epoch,
                  epoch_gen_state=gen.get_state())
    if ckpt is not None:
        st.restore(ckpt)
    _prepare_out(st, resumed=ckpt is not None)
    _write_config(st, coverage, extra_meta)
    main = st.main
    st.logs = Logs(JsonlLog(out / "steps.jsonl", main), JsonlLog(out / "epochs.jsonl", main),
                   JsonlLog(out / "evals.jsonl", main) if cfg["eval_every"] else None)
    st.show = not cfg["no_progress"] and sys.stderr.isatty() and main
    return st


def _resume_checkpoint(cfg: dict[str, Any], out: Path, error: Callable[[str], NoReturn]) -> Optional[dict[str, Any]]:
    """``--resume``'s checkpoint (None: not resuming, or none yet); a config mismatch is an error."""
    if not cfg["resume"]:
        return None
    try:
        ckpt, name = load_for_resume(out, lambda msg: print(msg, file=sys.stderr)) if out.is_dir() else (None, "")
    except CheckpointError as exc:
        error(f"--resume: {exc}")
    if ckpt is None:
        print(f"--resume: no {out / CHECKPOINT}, starting from scratch", file=sys.stderr)
        return None
    old = ckpt["config"]
    diff = [f"{k}: checkpoint {old.get(k)!r} vs now {cfg[k]!r}" for k in TRAJECTORY_KEYS if old.get(k) != cfg[k]]
    if diff:
        error(f"--resume: {out / name} was written with a different configuration: " + "; ".join(diff))
    return ckpt


def _datasets(cfg: dict[str, Any], device: torch.device, error: Callable[[str], NoReturn]) -> tuple[Any, Any]:
    """(train, test) on ``device``: ``--subset`` of the training set, ``--test-subset``
    (default: as ``--subset``; 0 = all) of the test set."""
    try:
        train_ds = zoo.get_dataset(cfg["dataset"], "train", cfg["data_dir"], download=cfg["download"])
        test_ds = zoo.get_dataset(cfg["dataset"], "test", cfg["data_dir"], download=cfg["download"])
    except (FileNotFoundError, ValueError) as exc:
        error(str(exc))
    if cfg["subset"] is not None:
        train_ds = zoo.subset(train_ds, cfg["subset"])
    n_test = cfg["subset"] if cfg.get("test_subset") is None else cfg["test_subset"]
    if n_test:
        test_ds = zoo.subset(test_ds, n_test)
    return train_ds.to(device), test_ds.to(device)


def _prepare_out(st: RunState, resumed: bool) -> None:
    """Resumed: the logs cut back to the checkpoint's step, the summary removed (the run is
    unfinished again); fresh: every earlier log and summary removed. Rank 0 only."""
    if not st.main:
        return
    if resumed:
        last_step = st.step
        for name in LOG_NAMES:
            truncate_jsonl(st.out / name, lambda r: r.get("step", 0) <= last_step)
        with contextlib.suppress(FileNotFoundError):
            (st.out / "summary.json").unlink()
    else:
        for name in (*LOG_NAMES, "summary.json"):
            with contextlib.suppress(FileNotFoundError):
                (st.out / name).unlink()
    remove_stale(st.out, fresh=not resumed)


def _write_config(st: RunState, coverage: Optional[str], extra_meta: dict[str, Any]) -> None:
    """``config.json`` (the resolved arguments and the run's sizes) and ``coverage.txt``."""
    if not st.main:
        return
    meta = dict(st.resolved, resume=st.cfg["resume"], steps_per_epoch=st.steps_per_epoch,
                n_train=len(st.train_ds), n_test=len(st.test_ds), **extra_meta)
    if st.dist is not None:
        meta["world_size"] = st.dist.world
    (st.out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    if coverage is not None:
        (st.out / "coverage.txt").write_text(coverage + "\n")
