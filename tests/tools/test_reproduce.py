"""``tengrad-reproduce``: end to end on a tiny synthetic Fashion-MNIST (a tiny CNN stands in
for 3C1F; every method with its paper settings), table, CSVs, plot, reuse of finished runs."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from testing.tiny_data import tiny_cnn
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
                      (["fmnist", "--seeds", "0"], "--seeds")):
        with pytest.raises(SystemExit):
            R.reproduce(argv)
        assert msg in capsys.readouterr().err
