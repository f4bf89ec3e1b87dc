"""Reading the run directories written by ``python -m tengrad_fx.cli.train --out DIR`` (shared by
``tengrad_fx.cli.plot``, ``tools.sweep`` and ``tools.sensitivity``).

A run directory holds (the agreed contract):

* ``config.json``  — the resolved arguments (model, dataset, optimizer, lr, weight_decay,
  damping, seed, epochs, batch_size, ...);
* ``steps.jsonl``  — one object per step: step, epoch, loss, acc, lr, train_time
  (cumulative training seconds, evaluation excluded);
* ``epochs.jsonl`` — one object per epoch: epoch, train_loss, train_acc, test_loss,
  test_acc, train_time, eval_time;
* ``evals.jsonl``  — (``--eval-every``) one object per evaluation between epoch ends: step,
  epoch (fractional), test_loss, test_acc, train_time, eval_time;
* ``summary.json`` — written last: test_acc, test_loss, train_time, eval_time, epochs,
  steps, optimizer. A directory without it is an unfinished (or failed) run.

Accuracies are expected as fractions in [0, 1]; a value above 1 is read as a percentage
and divided by 100 (:func:`frac`), so both conventions give the same tables and plots.
Spreads are sample standard deviations (``ddof=1``; 0 for a single run).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

__all__ = [
    "Run", "load_run", "find_runs", "frac", "mean_std", "band", "config_key", "group_runs",
    "time_to_target", "eval_points", "IGNORED_KEYS", "atomic_write_text",
]

IGNORED_KEYS = frozenset({
    "seed", "out", "no_progress", "threads", "data_dir", "download", "device", "progress",
    "log_every", "eval_every", "run_name", "save", "resume", "no_plot",
})
"""Config keys that do not define the experiment (runs differing only in them are repeats)."""


@dataclass
class Run:
    """One run directory, loaded."""

    path: str
    config: dict[str, Any]
    steps: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    summary: Optional[dict[str, Any]] = None

    @property
    def finished(self) -> bool:
        return self.summary is not None

    def get(self, key: str, default: Any = None) -> Any:
        """A config value, else a summary value, else ``default``."""
        if key in self.config:
            return self.config[key]
        if self.summary is not None and key in self.summary:
            return self.summary[key]
        return default

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))


def _read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut off by a crash or a live writer
                    break
    except FileNotFoundError:
        pass
    return out


def load_run(path: str) -> Run:
    """Load one run directory; raises ``FileNotFoundError`` if it has no ``config.json``."""
    cfg = _read_json(os.path.join(path, "config.json"))
    if cfg is None:
        raise FileNotFoundError(f"{path}: no config.json — not a run directory of tengrad_fx.cli.train")
    return Run(
        path=path,
        config=cfg,
        steps=_read_jsonl(os.path.join(path, "steps.jsonl")),
        epochs=_read_jsonl(os.path.join(path, "epochs.jsonl")),
        evals=_read_jsonl(os.path.join(path, "evals.jsonl")),
        summary=_read_json(os.path.join(path, "summary.json")),
    )


def find_runs(paths: Iterable[str], finished_only: bool = True) -> list[Run]:
    """Every run directory at or below ``paths`` (a run dir, or a folder of them, e.g. a
    sweep directory), sorted by path; unfinished runs are left out unless asked for."""
    found: list[str] = []
    for p in paths:
        if os.path.isfile(os.path.join(p, "config.json")):
            found.append(p)
            continue
        for root, dirs, files in os.walk(p):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            if "config.json" in files:
                found.append(root)
                dirs[:] = []
    runs = [load_run(p) for p in sorted(set(found))]
    return [r for r in runs if r.finished] if finished_only else runs


def frac(acc: Optional[float]) -> Optional[float]:
    """An accuracy as a fraction (values above 1 are taken as percentages)."""
    if acc is None:
        return None
    acc = float(acc)
    return acc / 100.0 if acc > 1.0 else acc


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (``ddof=1``; 0 for one value; NaN for none)."""
    vals = [float(v) for v in values]
    n = len(vals)
    if n == 0:
        return math.nan, math.nan
    mu = sum(vals) / n
    if n == 1:
        return mu, 0.0
    return mu, math.sqrt(sum((v - mu) ** 2 for v in vals) / (n - 1))


def band(xs: Sequence[Sequence[float]],
         ys: Sequence[Sequence[float]]) -> tuple[list[float], list[float], list[float]]:
    """Mean ± std band of several runs' curves (one per seed), aligned by index.

    Curves are cut to the shortest one (index ``k`` is the same epoch / step of every
    seed). Returns ``(x_mean, y_mean, y_std)`` as lists: ``x`` is averaged too, so for a
    wall-clock axis the point sits at the seeds' mean time of that epoch.
    """
    if len(xs) != len(ys):
        raise ValueError("band(): need one x series per y series")
    if not xs:
        return [], [], []
    n = min(min(len(x) for x in xs), min(len(y) for y in ys))
    x_mean, y_mean, y_std = [], [], []
    for k in range(n):
        x_mean.append(mean_std([x[k] for x in xs])[0])
        mu, sd = mean_std([y[k] for y in ys])
        y_mean.append(mu)
        y_std.append(sd)
    return x_mean, y_mean, y_std


def config_key(run: Run, group_by: Optional[Sequence[str]] = None) -> tuple[tuple[str, Any], ...]:
    """The grouping key of a run: the ``group_by`` config values, or (``None``) every
    config value but :data:`IGNORED_KEYS` (so seeds of one configuration group together)."""
    if group_by is None:
        keys = sorted(k for k in run.config if k not in IGNORED_KEYS)
    else:
        keys = list(group_by)
    return tuple((k, _hashable(run.get(k))) for k in keys)


def _hashable(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_hashable(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    return v


def group_runs(runs: Sequence[Run], group_by: Optional[Sequence[str]] = None) -> dict[tuple, list[Run]]:
    """Runs by :func:`config_key`, in first-seen order."""
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        groups.setdefault(config_key(r, group_by), []).append(r)
    return groups


def time_to_target(run: Run, target: float) -> Optional[float]:
    """Training seconds at the first evaluation with ``test_acc >= target`` (``target`` a
    fraction or a percentage); ``None`` if never reached."""
    t = frac(target)
    assert t is not None
    for e in run.epochs:
        acc = frac(e.get("test_acc"))
        if acc is not None and acc >= t - 1e-12:
            return float(e["train_time"])
    return None


def eval_points(run: Run) -> list[dict[str, Any]]:
    """Every test evaluation of a run in step order: the end-of-epoch ones (epochs.jsonl)
    and the ``--eval-every`` ones (evals.jsonl), one per step (the epoch's where both are).
    Each has ``step``, ``epoch``, ``test_acc``, ``test_loss``, ``train_time``; a run without
    evals.jsonl gives its epochs.jsonl as it is."""
    if not run.evals:
        return list(run.epochs)
    by_step = {int(e["step"]): e for e in run.evals}
    by_step.update({int(e["step"]): e for e in run.epochs})
    return [by_step[s] for s in sorted(by_step)]


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace`` (readers
    never see a half-written file; concurrent writers leave one complete version)."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.{id(text):x}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
