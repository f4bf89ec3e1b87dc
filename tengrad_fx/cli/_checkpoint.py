"""Checkpoint files of ``tengrad_fx.cli.train``: atomic writes, the last two kept, a truncated or
corrupt one detected on ``--resume`` and the previous good one used.

Files in ``--out``:

* ``checkpoint.pt`` -- the latest checkpoint; ``checkpoint.prev.pt`` -- the one before.
  A save writes a temporary file (``fsync``), then renames ``checkpoint.pt`` to
  ``checkpoint.prev.pt`` and the temporary file to ``checkpoint.pt`` (both ``os.replace``,
  atomic). A process killed at any moment leaves at least one complete checkpoint (if it
  had written one before), plus perhaps a leftover temporary file, removed at the next start.
* ``checkpoint.pt.corrupt`` -- a latest checkpoint that failed to load on ``--resume``
  (kept for inspection, out of the way of the rotation); the run resumed from
  ``checkpoint.prev.pt``.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = ["CHECKPOINT", "PREVIOUS", "CheckpointError", "save_checkpoint", "save_rotating",
           "load_checkpoint", "load_for_resume", "remove_stale"]

CHECKPOINT = "checkpoint.pt"
PREVIOUS = "checkpoint.prev.pt"
CORRUPT_SUFFIX = ".corrupt"
REQUIRED_KEYS = ("model", "optimizer", "epoch", "step", "batch_in_epoch", "rng", "config")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used (truncated, corrupt, or not a checkpoint)."""


def _write_temp(path: Path, obj: dict[str, Any]) -> str:
    """``torch.save`` to a new temporary file next to ``path`` (flushed to disk); its name."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def save_checkpoint(path: Path, obj: dict[str, Any]) -> None:
    """``torch.save`` to a temporary file next to ``path``, then ``os.replace`` (atomic)."""
    os.replace(_write_temp(path, obj), path)


def save_rotating(path: Path, obj: dict[str, Any]) -> None:
    """Save ``obj`` as ``path`` (atomic) and keep the former ``path`` as ``checkpoint.prev.pt``."""
    tmp = _write_temp(path, obj)
    if path.exists():
        os.replace(path, path.with_name(PREVIOUS))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """The checkpoint in ``path``; :class:`CheckpointError` naming the file and the cause
    when it is truncated, corrupt, or lacks a checkpoint's entries."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # truncated zip, bad pickle, random bytes: all unusable
        raise CheckpointError(f"{path} is truncated or corrupt ({type(exc).__name__}: {exc})") from exc
    if not isinstance(ckpt, dict) or any(k not in ckpt for k in REQUIRED_KEYS):
        missing = [k for k in REQUIRED_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
        raise CheckpointError(f"{path} is not a tengrad_fx.cli.train checkpoint (missing {missing})")
    return ckpt


def load_for_resume(out: Path, warn: Callable[[str], None]) -> tuple[Optional[dict[str, Any]], str]:
    """``(checkpoint, file name)`` to resume from, or ``(None, "")`` when ``out`` has none.

    The latest (``checkpoint.pt``) is tried first. If it cannot be loaded, ``warn`` says so,
    it is renamed to ``checkpoint.pt.corrupt`` and the previous one is used. Raises
    :class:`CheckpointError` when checkpoints exist but none can be loaded.
    """
    latest, prev = out / CHECKPOINT, out / PREVIOUS
    errors = []
    for path in (latest, prev):
        if not path.exists():
            continue
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as exc:
            errors.append(str(exc))
            continue
        if errors:  # the latest was bad: keep it aside, resume from the previous one
            os.replace(latest, latest.with_name(latest.name + CORRUPT_SUFFIX))
            warn(f"--resume: {errors[0]}; it is kept as {latest.name}{CORRUPT_SUFFIX} and the run resumes "
                 f"from the previous checkpoint {path} (step {ckpt['step']})")
        elif path == prev:
            warn(f"--resume: no {latest.name} (the run was stopped while replacing it); resuming from "
                 f"the previous checkpoint {path} (step {ckpt['step']})")
        return ckpt, path.name
    if errors:
        raise CheckpointError("; ".join(errors) + ": no usable checkpoint to resume from. Run without "
                              "--resume to start afresh (this deletes the run's files), or restore a checkpoint")
    return None, ""


def remove_stale(out: Path, fresh: bool) -> None:
    """Remove temporary files a killed save left behind; on a fresh (not resumed) run also
    every checkpoint file of an earlier run."""
    for p in out.glob(f".{CHECKPOINT}.*tmp"):
        with contextlib.suppress(OSError):
            p.unlink()
    if fresh:
        for name in (CHECKPOINT, PREVIOUS, CHECKPOINT + CORRUPT_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()
