"""``tengrad_fx.cli.train --distributed`` on 2 gloo ranks (spawned; what ``torchrun`` would start),
tiny CNN, float32: the run equals the single-process run on the same global batches,
only rank 0 writes, and its checkpoint resumes on the same world size (2 ranks) and on
another one (1 process, without ``--distributed``). The same spawn runs
``tengrad_fx.cli.reproduce --distributed`` (sgd and tengrad, 2 global batches of 128) twice: the
second call reuses the finished runs on every rank."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from testing.distributed import run_ranks
from testing.tiny_data import tiny_cnn, write_fashion_mnist
from tengrad_fx.cli import train as T

BASE = ["--subset", "32", "--batch-size", "16", "--epochs", "2", "--no-progress", "--no-plot",
        "--fisher", "empirical", "--curvature-every", "1", "--kl-clip", "0", "--lr", "0.05", "--damping", "0.1"]


def _reproduce_args(data_dir: str, out: str) -> list[str]:
    return ["fmnist", "--data-dir", data_dir, "--out", out, "--subset", "256", "--epochs", "1", "--device", "cpu",
            "--no-progress", "--threads", "1"]


def _cli_runs(rank: int, world: int, data_dir: str, runs: list[list[str]], rep_data: str,
              rep_out: str) -> list[dict[str, Any]]:
    from tengrad_fx.cli import reproduce as R
    T.build_model = tiny_cnn  # type: ignore[assignment]
    for extra in runs:
        T.run(["--data-dir", data_dir, *BASE, "--distributed", *extra])
    first = R.reproduce([*_reproduce_args(rep_data, rep_out), "--distributed"])
    lines = (Path(rep_out) / "tengrad-s0" / "steps.jsonl").read_text()
    second = R.reproduce([*_reproduce_args(rep_data, rep_out), "--distributed"])
    return [first, second, {"steps_after_first": lines}]


def _params(out: Path) -> torch.Tensor:
    sd = torch.load(out / T.CHECKPOINT, map_location="cpu", weights_only=False)["model"]
    return torch.cat([v.reshape(-1).double() for v in sd.values()])


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("dist_cli")
    rep_data = write_fashion_mnist(tmp_path_factory.mktemp("fmnist256"), n_train=256)
    full, part, rep = tmp / "full", tmp / "part", tmp / "rep"
    res = run_ranks(_cli_runs, 2, tmp / "ranks", str(data_dir),
                    [["--out", str(full)],
                     ["--out", str(part), "--max-steps", "2"],
                     ["--out", str(part), "--max-steps", "3", "--resume"]],  # same world size
                    str(rep_data), str(rep), timeout=240)
    return {"full": full, "part": part, "rep": rep, "rep_data": rep_data, "ranks": res}


def test_distributed_cli_matches_single_process_and_resumes(spawned: dict[str, Any], tmp_path: Path,
                                                            data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full, part = spawned["full"], spawned["part"]
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
    from tengrad_fx.cli._dist import check_distributed
    cfg = {"optimizer": "kfac", "compile": False, "batch_size": 16}
    assert "tengrad or sgd" in check_distributed(cfg, 2)
    assert "multiple of the world size" in check_distributed({**cfg, "optimizer": "tengrad", "batch_size": 15}, 2)
    assert check_distributed({**cfg, "optimizer": "sgd"}, 4) is None
    with pytest.raises(SystemExit):
        T.run(["--data-dir", str(data_dir), *BASE, "--out", str(tmp_path / "x"), "--distributed"])  # no torchrun env


def test_reproduce_distributed(spawned: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tengrad_fx.cli.reproduce --distributed`` on 2 ranks: rank 0 alone reports and writes; the
    runs are 2-rank ``tengrad_fx.cli.train --distributed`` runs; DDP-SGD equals single-process SGD
    on the same global batches; a second call reuses both runs on every rank."""
    rep = spawned["rep"]
    (first, second, info), (first1, second1, _) = spawned["ranks"]
    assert set(first["rows"]) == {"sgd", "tengrad"} and "Table 2 row" in first["table"]
    assert first1["rows"] == {} and first1["rank"] == 1 and first1["table"] == ""  # rank 1 reports nothing
    for method in ("sgd", "tengrad"):
        cfg = json.loads((rep / f"{method}-s0" / "config.json").read_text())
        assert cfg["world_size"] == 2 and cfg["distributed"] and cfg["batch_size"] == 128
        steps = (rep / f"{method}-s0" / "steps.jsonl").read_text().splitlines()
        assert len(steps) == 2  # 256 images, global batch 128: one line per step, rank 0 only
    cfg = json.loads((rep / "tengrad-s0" / "config.json").read_text())
    assert (cfg["fisher"], cfg["curvature_every"], cfg["kl_clip"]) == ("mc", 100, 0.01)  # the paper's settings
    # the second call trained nothing (rank 0 decided, rank 1 followed)
    assert (rep / "tengrad-s0" / "steps.jsonl").read_text() == info["steps_after_first"]
    assert second["rows"]["tengrad"]["acc"] == first["rows"]["tengrad"]["acc"] and second1["rows"] == {}
    # DDP-SGD on 2 ranks == SGD in one process on the same global batches
    from tengrad_fx.cli import reproduce as R
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    single = tmp_path / "single"
    R.reproduce([*_reproduce_args(str(spawned["rep_data"]), str(single)), "--methods", "sgd"])
    assert torch.allclose(_params(rep / "sgd-s0"), _params(single / "sgd-s0"), rtol=1e-4, atol=1e-6)


def test_reproduce_distributed_refuses_other_methods(capsys: pytest.CaptureFixture[str]) -> None:
    from tengrad_fx.cli import reproduce as R
    with pytest.raises(SystemExit):
        R.reproduce(["fmnist", "--distributed", "--methods", "kfac"])
    assert "no distributed mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        R.reproduce(["fmnist", "--distributed", "--device", "cpu"])  # no torchrun environment
    assert "torchrun" in capsys.readouterr().err
