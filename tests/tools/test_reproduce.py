"""``tengrad-reproduce``: end to end on a tiny synthetic Fashion-MNIST (a tiny CNN stands in
for 3C1F; every method with its paper settings), table, CSVs, plot, reuse of finished runs;
the CPU scale: TENGraD beside SGD on the same data and initial weights, evaluated every few
steps, compared in the summary."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from testing.tiny_data import tiny_cnn, write_fashion_mnist
from tengrad_fx.cli import _runs
from tengrad_fx.cli import reproduce as R
from tengrad_fx.cli import train as T


def test_fmnist_end_to_end(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    out = tmp_path / "rep"
    common = ["fmnist", "--data-dir", str(data_dir), "--out", str(out), "--subset", "64", "--epochs", "2",
              "--device", "cpu", "--no-progress"]
    res = R.reproduce(common)
    text = capsys.readouterr().out
    assert res["scaled"] and "SCALED DOWN" in text and res["device"] == "cpu"
    assert set(res["rows"]) == set(R.METHODS)
    for method, row in res["rows"].items():
        assert row["n"] == 1 and 0 <= row["acc"][0] <= 100
        assert (out / f"{method}-s0" / "summary.json").exists()
    # the row is printed beside the paper's numbers, e.g. TENGraD's "43 [93.15]"
    assert "time to 92.6% (s)" in text and "43 [93.15]" in text and "52 [92.60]" in text
    assert "Summary:" in text and str(out) in text
    with open(out / "table.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == list(R.METHODS) and table[1]["paper_acc"] == "93.15"
    with open(out / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert len(curves) == 5 * 2 and {r["epoch"] for r in curves} == {"1", "2"}  # 5 methods × 2 epochs
    assert (out / "curves.png").stat().st_size > 0 and (out / "curves.svg").stat().st_size > 0
    # paper settings reached every run: TENGraD MC + T=100 + clip, K-FAC's intervals
    cfg = json.loads((out / "tengrad-s0" / "config.json").read_text())
    assert (cfg["fisher"], cfg["curvature_every"], cfg["kl_clip"], cfg["lr"]) == ("mc", 100, 0.01, 0.003)
    assert json.loads((out / "kfac-s0" / "config.json").read_text())["optimizer_kwargs"]["inverse_every"] == 100

    # a second call reuses finished runs and adds only the new seed
    res2 = R.reproduce([*common, "--methods", "sgd,tengrad", "--seeds", "2"])
    text = capsys.readouterr().out
    assert "[sgd seed 0] reusing" in text and "[sgd seed 1] training" in text
    assert res2["rows"]["tengrad"]["n"] == 2 and " ± " in res2["table"]


def test_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, msg in ((["fmnist", "--methods", "adam"], "--methods"),
                      (["cifar10", "--model", "resnet18"], "--model"),
                      (["fmnist", "--seeds", "0"], "--seeds"),
                      (["fmnist", "--eval-every", "-1"], "--eval-every")):
        with pytest.raises(SystemExit):
            R.reproduce(argv)
        assert msg in capsys.readouterr().err


def test_cpu_scale_compares_tengrad_with_sgd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "data").mkdir()
    data = write_fashion_mnist(tmp_path / "data", n_train=1280, n_test=64)
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    monkeypatch.setattr(R, "CPU_SUBSET", 10 * R.BATCH)  # 10 steps: one evaluation per step
    monkeypatch.setattr(R, "CPU_TEST_SUBSET", 48)
    out = tmp_path / "rep"
    res = R.reproduce(["fmnist", "--methods", "tengrad,sgd", "--data-dir", str(data), "--out", str(out),
                       "--device", "cpu", "--no-progress"])
    text = capsys.readouterr().out
    assert res["scaled"] and "SCALED DOWN" in text and "every 1 steps" in text
    runs = {m: _runs.load_run(str(out / f"{m}-s0")) for m in ("tengrad", "sgd")}
    for run in runs.values():
        cfg = run.config
        assert (cfg["subset"], cfg["test_subset"], cfg["eval_every"], cfg["epochs"], cfg["seed"]) == (1280, 48, 1, 1, 0)
        assert run.get("n_test") == 48
        points = _runs.eval_points(run)
        assert [p["step"] for p in points] == list(range(1, 11))  # >= 8 evaluations, the last one not repeated
        assert len(run.evals) == 10 and run.epochs[0]["test_acc"] == run.evals[-1]["test_acc"]
    # same data, same order, same initial weights: the first batch's loss (before any update) agrees
    first = {m: run.steps[0]["loss"] for m, run in runs.items()}
    assert first["tengrad"] == pytest.approx(first["sgd"], rel=1e-5)
    assert runs["tengrad"].steps[3]["loss"] != pytest.approx(runs["sgd"].steps[3]["loss"], rel=1e-5)
    # the comparison: final accuracies and the first evaluation at the lower one, from the logs
    cmp = res["comparison"]
    finals = {m: 100.0 * run.summary["test_acc"] for m, run in runs.items()}  # type: ignore[index]
    assert {m: p["final"] for m, p in cmp["methods"].items()} == pytest.approx(finals)
    assert cmp["target"] == pytest.approx(min(finals.values()))
    for m, run in runs.items():
        hit = next(p for p in _runs.eval_points(run) if 100.0 * p["test_acc"] >= cmp["target"] - 1e-9)
        assert cmp["methods"][m]["to_target"] == pytest.approx((hit["step"], hit["train_time"], 1))
    lowest = cmp["lowest"]
    assert cmp["methods"][lowest]["to_target"][0] <= 10
    summary = res["summary"]
    assert f"To reach {cmp['target']:.2f} % ({lowest}'s final)" in summary
    assert f"tengrad {finals['tengrad']:.2f} %" in summary and f"sgd {finals['sgd']:.2f} %" in summary
    assert "For context only" in summary and "93.15 %" in summary and "(paper " not in summary
    with open(out / "curves.csv") as f:
        curves = list(csv.DictReader(f))
    assert [r["method"] for r in curves] == ["tengrad"] * 10 + ["sgd"] * 10
    assert [int(r["step"]) for r in curves[:10]] == list(range(1, 11))
    assert (out / "curves.png").stat().st_size > 0 and (out / "curves.svg").stat().st_size > 0
    from tengrad_fx.cli import plot

    acc_steps, acc_times, acc = plot.run_curves(runs["sgd"], x="step")["acc"]
    points = _runs.eval_points(runs["sgd"])
    assert acc_steps == list(range(1, 11)) and acc == pytest.approx([100.0 * p["test_acc"] for p in points])
    assert acc_times == [p["train_time"] for p in points] and acc_times == sorted(acc_times)
