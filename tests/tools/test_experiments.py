"""Experiment tools: plot, structure, sweep (+ summarize, resumability), sensitivity.

Run directories are fabricated here (the ``tengrad_fx.cli.train`` contract: config.json,
steps.jsonl, epochs.jsonl, summary.json); one integration test runs the real training CLI
through ``tools.sweep``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from tengrad_fx.cli import _runs, plot
from testing.repo_tools import REPO, tool

sensitivity, structure, sweep = (tool(n) for n in ("sensitivity", "structure", "sweep"))


def make_run(path, optimizer="tengrad", lr=0.003, weight_decay=0.001, damping=0.1, seed=0,
             epochs=((2.0, 0.60, 0.70, 10.0), (1.0, 0.80, 0.85, 20.0), (0.5, 0.90, 0.88, 30.0)),
             steps_per_epoch=4, finished=True, model="3c1f", dataset="fashion-mnist"):
    """Fabricate a run directory; ``epochs``: (train_loss, train_acc, test_acc, train_time) each."""
    os.makedirs(path, exist_ok=True)
    cfg = dict(model=model, dataset=dataset, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
               damping=damping if optimizer != "sgd" else None, seed=seed, epochs=len(epochs), batch_size=128,
               out=str(path), threads=2, no_progress=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    step, t_prev = 0, 0.0
    with open(os.path.join(path, "steps.jsonl"), "w") as fs, open(os.path.join(path, "epochs.jsonl"), "w") as fe:
        for e, (loss, tr_acc, te_acc, t) in enumerate(epochs, 1):
            for k in range(steps_per_epoch):
                step += 1
                fs.write(json.dumps(dict(step=step, epoch=e, loss=loss * (1.1 - 0.05 * k), acc=tr_acc, lr=lr,
                                         train_time=t_prev + (t - t_prev) * (k + 1) / steps_per_epoch)) + "\n")
            fe.write(json.dumps(dict(epoch=e, train_loss=loss, train_acc=tr_acc, test_loss=loss + 0.1,
                                     test_acc=te_acc, train_time=t, eval_time=0.5 * e)) + "\n")
            t_prev = t
    if finished:
        last = epochs[-1]
        with open(os.path.join(path, "summary.json"), "w") as f:
            json.dump(dict(test_acc=last[2], test_loss=last[0] + 0.1, train_time=last[3], eval_time=1.5,
                           epochs=len(epochs), steps=step, optimizer=optimizer, train_acc=last[1]), f)
    return str(path)


def _is_png(p):
    with open(p, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


def _is_svg(p):
    with open(p) as f:
        return "<svg" in f.read(2000)


# --------------------------------------------------------------------------- plot


def test_band_mean_and_sample_std():
    x, mu, sd = _runs.band([[1.0, 2.0, 3.0], [1.2, 2.2]], [[0.5, 0.6, 9.0], [0.7, 0.8]])
    assert len(x) == len(mu) == len(sd) == 2  # cut to the shortest seed
    assert x == pytest.approx([1.1, 2.1])
    assert mu == pytest.approx([0.6, 0.7])
    assert sd == pytest.approx([math.sqrt(0.02), math.sqrt(0.02)])  # ddof=1
    assert _runs.mean_std([3.0]) == (3.0, 0.0)
    m, s = _runs.mean_std([1.0, 2.0, 4.0])
    assert m == pytest.approx(7 / 3)
    assert s == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))


def test_plot_runs_two_seeds(tmp_path):
    d = tmp_path / "runs"
    for seed, shift in ((0, 0.0), (1, 0.02)):
        make_run(d / f"tengrad-s{seed}", seed=seed,
                 epochs=((2.0, 0.6, 0.70 + shift, 10.0), (1.0, 0.8, 0.85 + shift, 21.0)))
        make_run(d / f"sgd-s{seed}", optimizer="sgd", lr=0.03, seed=seed,
                 epochs=((2.2, 0.5, 0.60 + shift, 5.0), (1.5, 0.7, 0.75 + shift, 10.0)))
    make_run(d / "unfinished", finished=False)  # left out (no summary.json)
    paths = plot.plot_runs([str(d)], str(tmp_path / "fig" / "curves.png"))
    assert [os.path.basename(p) for p in paths] == ["curves.png", "curves.svg"]
    assert _is_png(paths[0]) and _is_svg(paths[1])
    groups = _runs.group_runs(_runs.find_runs([str(d)]), ("optimizer",))
    assert sorted(len(v) for v in groups.values()) == [2, 2]
    # the band of the tengrad group's test accuracy, as plot_runs computes it
    curves = [plot.run_curves(r) for r in groups[(("optimizer", "tengrad"),)]]
    x, mu, sd = _runs.band([c["acc"][1] for c in curves], [c["acc"][2] for c in curves])
    assert x == pytest.approx([10.0, 21.0])
    assert mu == pytest.approx([71.0, 86.0])
    assert sd == pytest.approx([math.sqrt(2.0)] * 2)  # 70 and 72 -> sample std sqrt(2)
    # CLI, one run directory, per-step losses (a single epoch per run)
    one = make_run(tmp_path / "single", epochs=((2.0, 0.6, 0.7, 10.0),))
    out = plot.main([one, "--out", str(tmp_path / "single.png"), "--group-by", "config"])
    assert all(os.path.getsize(p) > 0 for p in out)


# --------------------------------------------------------------------------- structure


def test_structure_tengrad_exact_kfac_not(tmp_path):
    res = structure.block_structure("small", slice_size=24, rows=None, damping=0.1, m=16)
    d = res.distances()
    assert res.exact.shape == res.tengrad.shape == res.kfac.shape == (24, 24)
    assert d["tengrad"] < 1e-8
    assert d["kfac"] > 1e-3
    paths = structure.plot_structure(res, str(tmp_path / "st.png"))
    assert _is_png(paths[0]) and _is_svg(paths[1])
    # the eigendecomposition route of the exact inverse (used for large layers) agrees
    import torch

    g = torch.Generator().manual_seed(0)
    layer_J = torch.randn(8, 40, generator=g, dtype=torch.float64)
    idx = structure.slice_indices(4, 10, 12, rows=3)
    assert idx.tolist() == [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23]
    dense = structure.exact_inverse(layer_J, 0.1, idx, dense_max=1000)
    eig = structure.exact_inverse(layer_J, 0.1, idx, dense_max=1)
    assert torch.allclose(dense, eig, atol=1e-10)


def test_structure_cli_rows_slice(tmp_path, capsys):
    d = structure.main(["--model", "small", "--rows", "4", "--slice", "16", "--m", "12", "--damping", "0.05",
                        "--out", str(tmp_path / "s.png")])
    assert d["tengrad"] < 1e-8 and d["kfac"] > 1e-3
    assert os.path.exists(tmp_path / "s.png") and os.path.exists(tmp_path / "s.svg")
    assert "TENGraD" in capsys.readouterr().out


# --------------------------------------------------------------------------- sweep


def _fabricate_sweep(root):
    runs = root / "runs"
    # tengrad: lr 0.003 is best by mean test acc (0.88, 0.90) vs lr 0.01 (0.86, 0.87)
    for lr, accs, times in ((0.003, (0.88, 0.90), (30.0, 34.0)), (0.01, (0.86, 0.87), (20.0, 22.0))):
        for seed, (acc, t) in enumerate(zip(accs, times)):
            make_run(runs / sweep.point_name("tengrad", (lr, 0.001, 0.1), seed), lr=lr, seed=seed,
                     epochs=((2.0, 0.7, 0.80, t / 3), (1.0, 0.8, acc - 0.01, 2 * t / 3), (0.5, 0.9, acc, t)))
    for seed, (acc, t) in enumerate(((0.84, 10.0), (0.86, 12.0))):
        make_run(runs / sweep.point_name("sgd", (0.03, 0.001, None), seed), optimizer="sgd", lr=0.03, seed=seed,
                 epochs=((2.0, 0.7, 0.80, t / 2), (1.0, 0.8, acc, t)))


def test_sweep_summarize_best_point_and_time_to_target(tmp_path, capsys):
    _fabricate_sweep(tmp_path)
    entries = {e["method"]: e for e in sweep.summarize([str(tmp_path)], target_acc=0.86)}
    te = entries["tengrad"]
    assert te["point"] == {"lr": 0.003, "weight_decay": 0.001, "damping": 0.1}
    assert te["n"] == 2 and te["n_points"] == 2 and te["seeds"] == [0, 1]
    assert te["acc_mean"] == pytest.approx(89.0) and te["acc_std"] == pytest.approx(math.sqrt(2.0))
    assert te["time_mean"] == pytest.approx(32.0) and te["time_std"] == pytest.approx(math.sqrt(8.0))
    # first evaluation with test_acc >= 0.86: seed 0 at epoch 2 (0.87, t=20), seed 1 at epoch 2 (0.89, t=34*2/3)
    assert te["ttt_reached"] == 2
    assert te["ttt_mean"] == pytest.approx((20.0 + 34.0 * 2 / 3) / 2)
    sg = entries["sgd"]
    assert sg["point"]["damping"] is None and sg["acc_mean"] == pytest.approx(85.0)
    assert sg["ttt_reached"] == 1 and sg["ttt_mean"] == pytest.approx(12.0) and sg["ttt_std"] == 0.0
    # percent target == fraction target
    assert sweep.summarize([str(tmp_path)], target_acc=86)[0]["ttt_mean"] == pytest.approx(te["ttt_mean"])
    sweep.main(["summarize", str(tmp_path), "--target-acc", "0.86"])
    out = capsys.readouterr().out
    assert "32.0 ± 2.8 [89.00 ± 1.41]" in out and "time to 86% (s)" in out and "(1/2)" in out
    # results.csv regenerated from the run directories
    path = sweep.write_results(str(tmp_path), target_acc=0.86)
    rows = sweep.read_results(path)
    assert len(rows) == 6
    assert list(rows[0])[:8] == ["optimizer", "lr", "weight_decay", "damping", "seed", "test_acc", "train_time",
                                 "time_to_target"]
    sgd0 = [r for r in rows if r["optimizer"] == "sgd" and r["seed"] == 0][0]
    assert sgd0["damping"] is None and sgd0["time_to_target"] is None and sgd0["test_acc"] == pytest.approx(0.84)


def test_sweep_resumes_and_skips_finished_points(tmp_path):
    out = tmp_path / "sw"
    args = sweep.parse_sweep_args(["--optimizer", "tengrad", "--lr", "0.001,0.003", "--weight-decay", "0.001",
                                   "--damping", "0.1", "--seeds", "0,1", "--epochs", "1", "--subset", "64",
                                   "--max-steps", "2", "--target-acc", "0.5", "--out", str(out),
                                   "--", "--fisher", "mc"])
    assert args.extra == ["--fisher", "mc"]
    done = sweep.point_name("tengrad", (0.001, 0.001, 0.1), 1)
    make_run(out / "runs" / done, lr=0.001, seed=1)
    make_run(out / "runs" / sweep.point_name("tengrad", (0.003, 0.001, 0.1), 0), lr=0.003, finished=False)
    calls = []

    def fake_runner(cmd, log_path):
        calls.append(cmd)
        def val(flag):
            return cmd[cmd.index(flag) + 1]

        assert cmd[1:3] == ["-m", "tengrad_fx.cli.train"] and val("--fisher") == "mc" and val("--max-steps") == "2"
        make_run(val("--out"), lr=float(val("--lr")), seed=int(val("--seed")))
        return 0

    res = sweep.run_sweep(args, runner=fake_runner)
    assert len(calls) == 3 and res["ran"] == 3 and res["skipped"] == 1 and not res["failed"]
    assert all(done not in c[c.index("--out") + 1] for c in calls)
    with open(res["csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4 and {r["time_to_target"] for r in rows} == {"10.0"}
    assert not [p for p in os.listdir(out / "runs") if p.endswith(".lock")]
    calls.clear()
    sweep.run_sweep(args, runner=fake_runner)  # everything done: nothing runs
    assert calls == []
    # a point locked by a live process is left alone
    args2 = sweep.parse_sweep_args(["--optimizer", "sgd", "--lr", "0.01", "--weight-decay", "0.001",
                                    "--out", str(out)])
    name = sweep.point_name("sgd", (0.01, 0.001, None), 0)
    with open(out / "runs" / (name + ".lock"), "w") as f:
        f.write(str(os.getpid()))
    res = sweep.run_sweep(args2, runner=fake_runner)
    assert calls == [] and res["busy"] == [name]


def test_sweep_default_grids_are_the_papers():
    a = sweep.parse_sweep_args(["--optimizer", "kfac", "--out", "x"])
    assert a.lr == [0.001, 0.003, 0.01, 0.03, 0.1, 0.3]
    assert a.weight_decay == [0.001, 0.003, 0.01, 0.03, 0.1, 0.3]
    assert a.damping == [0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3]
    assert len(sweep.grid_points("kfac", a.lr, a.weight_decay, a.damping)) == 6 * 6 * 7
    assert len(sweep.grid_points("sgd", a.lr, a.weight_decay, a.damping)) == 36


# --------------------------------------------------------------------------- sensitivity


def test_sensitivity_heatmap(tmp_path):
    runs = tmp_path / "runs"
    for lr in (0.001, 0.01):
        for d in (0.01, 0.1, 0.3):
            for wd in (0.001, 0.01):
                for seed in (0, 1):
                    acc = 0.8 + 0.01 * seed + (0.05 if wd == 0.01 else 0.0) + lr
                    make_run(runs / sweep.point_name("tengrad", (lr, wd, d), seed), lr=lr, weight_decay=wd,
                             damping=d, seed=seed, epochs=((1.0, acc - 0.05, acc, 5.0),))
    sweep.write_results(str(tmp_path))
    grid = sensitivity.sensitivity_grid(sweep.read_results(str(tmp_path / "results.csv")))
    assert grid["lrs"] == [0.001, 0.01] and grid["dampings"] == [0.01, 0.1, 0.3]
    assert grid["test"][1, 2] == pytest.approx(100 * (0.8 + 0.005 + 0.05 + 0.01))  # best wd = 0.01
    assert grid["wd"][0, 0] == pytest.approx(0.01) and (grid["n"] == 2).all()
    paths = sensitivity.main([str(tmp_path), "--out", str(tmp_path / "sens.png")])
    assert _is_png(paths[0]) and _is_svg(paths[1])


# --------------------------------------------------------------------------- integration


def test_sweep_runs_the_training_cli(tmp_path):
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "tools.sweep", "--optimizer", "sgd", "--model", "3c1f",
           "--dataset", "fashion-mnist", "--lr", "0.001,0.003", "--weight-decay", "0.001", "--seeds", "0",
           "--epochs", "1", "--subset", "128", "--max-steps", "2", "--batch-size", "16", "--jobs", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    logs = "".join(open(os.path.join(out, "logs", f)).read()[-2000:] for f in os.listdir(out / "logs")) \
        if (out / "logs").exists() else ""
    assert proc.returncode == 0, proc.stdout + proc.stderr + logs
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert sorted(float(r["lr"]) for r in rows) == [0.001, 0.003]
    assert all(0.0 <= float(r["test_acc"]) <= 1.0 and float(r["train_time"]) > 0 for r in rows)
