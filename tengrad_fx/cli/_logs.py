"""The training loop's logs: jsonl files (append, cut back on resume) and the per-step values
kept on the device between log points (:class:`StepBuffer`)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import Tensor

__all__ = ["JsonlLog", "StepBuffer", "skipped_by_optimizer", "truncate_jsonl"]


def truncate_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Keep only the lines of a jsonl log that satisfy ``keep`` (used on resume)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a half-written last line of a killed run
        if keep(rec):
            kept.append(line)
    path.write_text("".join(f"{line}\n" for line in kept))


def skipped_by_optimizer(opt: torch.optim.Optimizer) -> int:
    """``opt.counters["skipped"]`` (a host read), 0 for an optimizer without counters."""
    counters = getattr(opt, "counters", None)
    if isinstance(counters, dict):
        return int(counters.get("skipped", 0))
    return 0


class JsonlLog:
    """Appends JSON lines to ``path`` (nothing at all when ``active`` is False: ranks > 0)."""

    def __init__(self, path: Path, active: bool = True):
        self.path = path
        self._f = open(path, "a") if active else None

    def write(self, rec: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(rec) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


class StepBuffer:
    """The steps since the last log point: host fields (``step``, ``epoch``, ``lr``,
    ``train_time``, batch size) and, per step, three device scalars — the loss (before the
    update), the number of correct predictions and whether the step was skipped (``bool``)
    — or host values where the loop read them anyway. :meth:`flush` reads all device values
    with one host sync and returns the ``steps.jsonl`` records in step order."""

    def __init__(self) -> None:
        self._host: list[dict[str, Any]] = []
        self._dev: list[list[Any]] = []  # per step: [loss, correct, skipped]

    def __len__(self) -> int:
        return len(self._host)

    def add(self, host: dict[str, Any], loss: Any, correct: Any, skipped: Any) -> None:
        """One step: ``host`` (``step``, ``epoch``, ``lr``, ``train_time``, ``bs``); ``loss``,
        ``correct``, ``skipped``: 0-dim tensors (read at :meth:`flush`) or Python numbers."""
        self._host.append(host)
        self._dev.append([loss, correct, skipped])

    def flush(self) -> list[dict[str, Any]]:
        """``[{step, epoch, loss, acc, lr, train_time, skipped, bs, correct}]`` of the buffered steps
        (``loss``: a Python float, ``nan``/``inf`` kept), then empty; one ``tolist`` of all
        device values."""
        if not self._host:
            return []
        values = _read(self._dev)
        out = []
        for host, (loss, correct, skipped) in zip(self._host, values):
            bs = host["bs"]
            out.append({"step": host["step"], "epoch": host["epoch"], "loss": float(loss), "acc": correct / bs,
                        "lr": host["lr"], "train_time": host["train_time"],
                        "skipped": bool(skipped) or not math.isfinite(loss), "bs": bs, "correct": int(correct)})
        self._host, self._dev = [], []
        return out


def _read(rows: list[list[Any]]) -> list[list[float]]:
    """The values of ``rows`` on the host: every tensor entry gathered into one float64
    vector, read with one ``tolist`` (float64 holds a float32 loss and the counts exactly)."""
    tensors = [v for row in rows for v in row if isinstance(v, Tensor)]
    read: Optional[list[float]] = None
    if tensors:
        dev = tensors[0].device
        read = torch.stack([t.detach().to(device=dev, dtype=torch.float64) for t in tensors]).tolist()
    it = iter(read or [])
    return [[next(it) if isinstance(v, Tensor) else float(v) for v in row] for row in rows]
