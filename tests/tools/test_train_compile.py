"""``tengrad-train --compile``: a compiled model's TENGraD steps equal the eager ones to
float32 rounding over 20 steps (curvature every step and every third), and the
compilation is done before the first step, reported once and kept out of train_time."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tengrad_fx.cli import train as T

from testing.tiny_data import tiny_cnn


def _run(out: Path, data_dir: Path, T_every: int, compiled: bool) -> dict[str, Any]:
    argv = ["--data-dir", str(data_dir), "--out", str(out), "--subset", "40", "--batch-size", "16",
            "--no-progress", "--no-plot", "--optimizer", "tengrad", "--curvature-every", str(T_every),
            "--epochs", "10", "--max-steps", "20", "--threads", "1", *(["--compile"] if compiled else [])]
    return T.run(argv)


def _steps(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("T_every", [1, 3])
def test_compiled_training_equals_eager(T_every: int, data_dir: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(T, "build_model", tiny_cnn)  # Conv -> ReLU -> ... -> Linear -> ReLU -> Linear
    eager = _run(tmp_path / "eager", data_dir, T_every, False)
    compiled = _run(tmp_path / "compiled", data_dir, T_every, True)
    assert eager["compile_time"] is None and compiled["compile_time"] > 0
    assert capsys.readouterr().out.count("--compile: compiled in") == 1
    a, b = _steps(tmp_path / "eager"), _steps(tmp_path / "compiled")
    assert len(a) == len(b) == 20
    assert max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)) <= 1e-5
    pa = torch.load(tmp_path / "eager" / T.CHECKPOINT, weights_only=False)["model"]
    pb = torch.load(tmp_path / "compiled" / T.CHECKPOINT, weights_only=False)["model"]
    for k in pa:
        assert ((pa[k] - pb[k]).norm() / pa[k].norm().clamp_min(1e-12)).item() <= 1e-4, k
    # every step kind was compiled before the clock started: no step holds a compilation
    times = [y["train_time"] - x["train_time"] for x, y in zip([{"train_time": 0.0}] + b, b)]
    assert max(times) < 0.5 * compiled["compile_time"], (times, compiled["compile_time"])
