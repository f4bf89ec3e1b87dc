"""The training CLI's loop reads nothing from the device between log points (TENGraD, the
paper's MC Fisher): host syncs counted at dispatch (:class:`tengrad_fx.utils.dispatch.SyncCounter`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tengrad_fx.cli import _logs
from tengrad_fx.cli import train as T
from tengrad_fx.utils.dispatch import SyncCounter

from testing.tiny_data import tiny_cnn


def _steps_between_log_points(tmp_path: Path, data_dir: Path, monkeypatch: pytest.MonkeyPatch,
                              *extra: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """``[("add" | "flush", syncs so far)]`` over a 20-step run (64 samples, batch 4: 16
    steps per epoch), and the summary."""
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    events: list[tuple[str, int]] = []
    sc = SyncCounter()
    real_add, real_flush = _logs.StepBuffer.add, _logs.StepBuffer.flush

    def add(self: _logs.StepBuffer, *a: Any) -> None:
        real_add(self, *a)
        events.append(("add", sc.count))

    def flush(self: _logs.StepBuffer) -> list[dict[str, Any]]:
        events.append(("flush", sc.count))
        return real_flush(self)

    monkeypatch.setattr(_logs.StepBuffer, "add", add)
    monkeypatch.setattr(_logs.StepBuffer, "flush", flush)
    argv = ["--data-dir", str(data_dir), "--out", str(tmp_path / "run"), "--batch-size", "4", "--epochs", "2",
            "--max-steps", "20", "--no-progress", "--no-plot", "--optimizer", "tengrad", *extra]
    with sc:
        summary = T.run(argv)
    return events, summary


def test_no_host_sync_between_log_points(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events, summary = _steps_between_log_points(tmp_path, data_dir, monkeypatch, "--curvature-every", "5")
    assert summary["steps"] == 20 and summary["skipped_steps"] == 0
    adds = [i for i, (kind, _) in enumerate(events) if kind == "add"]
    assert len(adds) == 20
    checked = 0
    for prev, cur in zip(adds, adds[1:]):
        if cur == prev + 1:  # consecutive steps, no log point between them
            assert events[cur][1] == events[prev][1], f"host sync in step {adds.index(cur) + 1}"
            checked += 1
    assert checked >= 17  # steps 2-16 and 18-20 (17 follows the epoch's log point)
    assert [e for e, _ in events].count("flush") <= 4  # epoch end, stop (and the no-op calls there)
    steps = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 21))


def test_log_every_writes_every_step_at_log_points(data_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``--log-every 3``: a log point every 3 steps; steps.jsonl still has one line per step."""
    events, summary = _steps_between_log_points(tmp_path, data_dir, monkeypatch, "--log-every", "3")
    flushes = [i for i, (kind, _) in enumerate(events) if kind == "flush"]
    adds_before = [sum(1 for k, _ in events[:i] if k == "add") for i in flushes]
    assert {3, 6, 9, 12, 15, 16, 19, 20} <= set(adds_before)
    steps = [json.loads(x) for x in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, 21)) and summary["steps"] == 20
