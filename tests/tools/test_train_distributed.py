"""``tools.train --distributed`` on 2 gloo ranks (spawned; what ``torchrun`` would start),
tiny CNN, float32: the run equals the single-process run on the same global batches,
only rank 0 writes, and its checkpoint resumes on the same world size (2 ranks) and on
another one (1 process, without ``--distributed``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from testing.distributed import run_ranks
from testing.tiny_data import tiny_cnn
from tools import train as T

BASE = ["--subset", "32", "--batch-size", "16", "--epochs", "2", "--no-progress", "--no-plot",
        "--fisher", "empirical", "--curvature-every", "1", "--kl-clip", "0", "--lr", "0.05", "--damping", "0.1"]


def _cli_runs(rank: int, world: int, data_dir: str, runs: list[list[str]]) -> int:
    T.build_model = tiny_cnn  # type: ignore[assignment]
    for extra in runs:
        T.run(["--data-dir", data_dir, *BASE, "--distributed", *extra])
    return rank


def _params(out: Path) -> torch.Tensor:
    sd = torch.load(out / T.CHECKPOINT, map_location="cpu", weights_only=False)["model"]
    return torch.cat([v.reshape(-1).double() for v in sd.values()])


def test_distributed_cli_matches_single_process_and_resumes(tmp_path: Path, data_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    full, part = tmp_path / "full", tmp_path / "part"
    run_ranks(_cli_runs, 2, tmp_path / "ranks", str(data_dir),
              [["--out", str(full)],
               ["--out", str(part), "--max-steps", "2"],
               ["--out", str(part), "--max-steps", "3", "--resume"]])  # same world size
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    single = tmp_path / "single"
    T.run(["--data-dir", str(data_dir), *BASE, "--out", str(single)])
    steps = [json.loads(x) for x in (full / "steps.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (single / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # rank 0 only: not one line per rank
    for s, r in zip(steps, ref):  # the global batch's loss, as in one process
        assert s["loss"] == pytest.approx(r["loss"], rel=1e-5) and s["acc"] == r["acc"]
    assert json.loads((full / "config.json").read_text())["world_size"] == 2
    assert torch.allclose(_params(full), _params(single), rtol=1e-4, atol=1e-6)
    # resume on another world size: one process, plain TENGraD, from the 2-rank checkpoint
    T.run(["--data-dir", str(data_dir), *BASE, "--out", str(part), "--resume"])
    summary = json.loads((part / "summary.json").read_text())
    assert summary["resumed_at_steps"] == [2, 3] and summary["steps"] == 4
    assert torch.allclose(_params(part), _params(single), rtol=1e-4, atol=1e-6)


def test_distributed_refuses_bad_setups(data_dir: Path, tmp_path: Path) -> None:
    from tools._dist import check_distributed
    cfg = {"optimizer": "kfac", "compile": False, "batch_size": 16}
    assert "tengrad or sgd" in check_distributed(cfg, 2)
    assert "multiple of the world size" in check_distributed({**cfg, "optimizer": "tengrad", "batch_size": 15}, 2)
    assert check_distributed({**cfg, "optimizer": "sgd"}, 4) is None
    with pytest.raises(SystemExit):
        T.run(["--data-dir", str(data_dir), *BASE, "--out", str(tmp_path / "x"), "--distributed"])  # no torchrun env
