"""``tools.peer_bench`` on the tiny synthetic Fashion-MNIST and the ``tiny`` 3C1F: every
method's run has its curve, targets and interleaved step-cost ratio in ``results.json``;
the peers need the ``peers`` extra and say so, the rest run without it."""
from __future__ import annotations

import json
import sys

import pytest

from testing.repo_tools import tool

peer_bench = tool("peer_bench")

RUN_KEYS = {"method", "lr", "lr_default", "settings", "family", "ratio_to_sgd", "step_seconds_mean",
            "step_seconds_median", "steps", "seconds", "diverged_at", "final_acc", "final_loss", "acc_at", "loss_at",
            "peak_memory_mb", "curve", "targets"}
CONFIG_KEYS = {"model", "dataset", "methods", "steps", "batch_size", "eval_every", "eval_subset", "targets",
               "lr_grid", "lr_factors", "warmup", "seed", "device", "threads", "torch", "date_utc",
               "sgd_step_seconds", "versions"}


def _run(data_dir, out, methods: str, *extra: str) -> dict:  # type: ignore[no-untyped-def,type-arg]
    peer_bench.main(["--model", "tiny", "--data-dir", str(data_dir), "--methods", methods, "--steps", "4",
                     "--batch-size", "8", "--eval-every", "2", "--eval-subset", "16", "--warmup", "1",
                     "--targets", "0.5,99", "--threads", "1", "--out", str(out), *extra])
    return json.loads((out / "results.json").read_text())


def _check(res: dict, methods: list[str], per_method: int) -> None:  # type: ignore[type-arg]
    assert CONFIG_KEYS <= set(res["config"]), CONFIG_KEYS - set(res["config"])
    assert res["config"]["targets"] == [0.5, 0.99]
    runs = res["runs"]
    assert [r["method"] for r in runs] == [m for m in methods for _ in range(per_method)]
    for r in runs:
        assert set(r) == RUN_KEYS, set(r) ^ RUN_KEYS
        assert r["steps"] == 4 and r["diverged_at"] is None
        assert [c["step"] for c in r["curve"]] == [0, 2, 4]
        assert set(r["curve"][0]) == {"step", "seconds", "est_seconds", "test_acc", "test_loss"}
        assert r["ratio_to_sgd"] > 0 and r["seconds"] > 0
        assert set(r["targets"]) == {"0.5", "0.99"} and r["targets"]["0.99"] is None
        c = r["curve"][-1]
        assert c["est_seconds"] == pytest.approx(4 * r["ratio_to_sgd"] * res["config"]["sgd_step_seconds"])
    assert list(res["summary"]) == methods
    for m, s in res["summary"].items():
        assert s["lr_won"] in {r["lr"] for r in runs if r["method"] == m}
    ref = next(r for r in runs if r["method"] == "sgd" and r["lr"] == r["lr_default"])
    assert ref["ratio_to_sgd"] == pytest.approx(1.0)


def test_project_methods_run_without_the_peers_extra(data_dir, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """SGD, AdamW, TENGraD and K-FAC with ``pytorch_optimizer`` unimportable; a peer then
    fails naming the extra."""
    monkeypatch.setitem(sys.modules, "pytorch_optimizer", None)
    res = _run(data_dir, tmp_path, "adamw,tengrad,kfac")
    _check(res, ["sgd", "adamw", "tengrad", "kfac"], 1)
    assert {r["method"]: r["family"] for r in res["runs"]} == {"sgd": "baseline", "adamw": "rival",
                                                               "tengrad": "tengrad", "kfac": "baseline"}
    assert res["verdict"]["final_acc"]["tengrad"]["method"] == "tengrad"
    assert "fastest TENGraD against the fastest of adamw" in peer_bench.report(res)
    assert {"results.json", "curves.csv", "summary.csv"} <= {p.name for p in tmp_path.iterdir()}
    lines = (tmp_path / "curves.csv").read_text().splitlines()
    assert lines[0].split(",") == peer_bench.CURVE_COLUMNS and len(lines) == 1 + 4 * 3
    with pytest.raises(ImportError, match=r"tengrad-fx\[peers\]"):
        _run(data_dir, tmp_path, "sgd,muon")


def test_tengrad_variant(data_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--tengrad NAME:key=value``: TENGraD at the paper's settings plus those options, its own row."""
    res = _run(data_dir, tmp_path, "sgd,tengrad", "--tengrad", "k2:curvature_samples=2,lr=0.01")
    _check(res, ["sgd", "tengrad", "k2"], 1)
    k2 = next(r for r in res["runs"] if r["method"] == "k2")
    assert k2["lr"] == 0.01 and "'curvature_samples': 2" in k2["settings"]


def test_peer_and_lr_grid(data_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A peer (PSGD's Kron) beside SGD, AdamW and TENGraD, on a 3-point lr grid."""
    pytest.importorskip("pytorch_optimizer")
    res = _run(data_dir, tmp_path, "sgd,adamw,tengrad,psgd", "--lr-grid", "3")
    _check(res, ["sgd", "adamw", "tengrad", "psgd"], 3)
    assert res["config"]["lr_factors"] == pytest.approx([1 / 3, 1, 3])
    assert res["config"]["versions"]["pytorch-optimizer"]
    assert "psgd" in peer_bench.report(res)


def test_lr_factors_and_batch_order() -> None:
    assert peer_bench.lr_factors(1) == [1.0]
    with pytest.raises(ValueError):
        peer_bench.lr_factors(2)
    order = peer_bench.batch_order(10, 4, 5, seed=0)
    assert [len(i) for i in order] == [4] * 5  # two per epoch (the partial batch dropped)
    assert set(order[0].tolist()).isdisjoint(order[1].tolist())
    assert all((a == b).all() for a, b in zip(order, peer_bench.batch_order(10, 4, 5, seed=0)))


def test_cosine_schedule(data_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``--schedule cosine``: every run's lr times ½(1 + cos(π·t/steps)), 0 after the last step
    (here TENGraD's too); the config records it."""
    import torch
    import torch.nn as nn

    f = peer_bench.lr_multiplier("cosine", 4)
    assert [f(t) for t in range(5)] == pytest.approx([1.0, 0.5 + 0.5 ** 1.5, 0.5, 0.5 - 0.5 ** 1.5, 0.0])
    assert peer_bench.lr_multiplier("constant", 4)(3) == 1.0
    base = nn.Sequential(nn.Flatten(), nn.Linear(4, 3))
    x, y = torch.randn(6, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    run = peer_bench.make_run(peer_bench.METHODS["sgd"], 0.1, base, x, "cosine", 4)
    for t in range(4):
        assert run.opt.param_groups[0]["lr"] == pytest.approx(0.1 * f(t))
        run.step(x, y, lambda: None)
    assert run.opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    res = _run(data_dir, tmp_path, "sgd,tengrad", "--schedule", "cosine")
    _check(res, ["sgd", "tengrad"], 1)
    assert res["config"]["schedule"] == "cosine"


def test_verdict_names_the_fastest_tengrad_and_rival() -> None:
    """Per target the fastest TENGraD and the fastest rival by estimated seconds (SGD, a
    baseline, is faster than both and is not counted), their ratio, and the best final
    accuracy of each family; a target only one family reached has no ratio."""
    def row(family: str, acc: float, *hits: float | None) -> dict:  # type: ignore[type-arg]
        return {"family": family, "final_acc": acc,
                "targets": {t: None if h is None else {"est_seconds": h} for t, h in zip(("0.85", "0.88"), hits)}}
    summary = {"sgd": row("baseline", 0.95, 0.1, 0.2), "tengrad": row("tengrad", 0.90, 3.0, None),
               "tengrad-orth": row("tengrad", 0.91, 2.0, None), "adamw": row("rival", 0.92, 4.0, 5.0),
               "muon": row("rival", 0.93, 1.0, 6.0)}
    v = peer_bench.verdict(summary, ["0.85", "0.88"])
    assert v["targets"]["0.85"] == {"tengrad": {"method": "tengrad-orth", "est_seconds": 2.0},
                                    "rival": {"method": "muon", "est_seconds": 1.0}, "ratio": 2.0}
    assert v["targets"]["0.88"] == {"tengrad": None, "rival": {"method": "adamw", "est_seconds": 5.0}, "ratio": None}
    assert v["final_acc"] == {"tengrad": {"method": "tengrad-orth", "final_acc": 0.91},
                              "rival": {"method": "muon", "final_acc": 0.93}}
    lines = peer_bench.verdict_lines(v)
    assert lines[1] == "  to 0.85: tengrad-orth 2 s, muon 1 s: 2.00x"
    assert lines[2] == "  to 0.88: no TENGraD against adamw"
    assert peer_bench.verdict_lines(peer_bench.verdict({"sgd": summary["sgd"]}, ["0.85"])) == []
