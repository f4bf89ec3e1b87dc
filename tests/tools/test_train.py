"""The training CLI ``tengrad_fx.cli.train``: short runs, logs, atomic checkpoints, bit-identical resume.

Runs go in-process through :func:`tengrad_fx.cli.train.run` on a tiny synthetic Fashion-MNIST
(IDX files written to a temporary ``--data-dir``), ``--subset 32``, batch 16. SGD and
TENGraD run the real 3C1F; tests of the CLI's plumbing (logs, errors, checkpoint files) and
the registry optimizers run a tiny CNN patched in for ``build_model`` (K-FAC's first
inversion of 3C1F's 10369×10369 input factor alone takes minutes on 2 CPU cores).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tengrad_fx import zoo
from tengrad_fx.cli import train as T

from testing.tiny_data import tiny_cnn as _tiny_cnn

REGISTRY_OPTIMIZERS = ("kfac", "ekfac", "kbfgs")

STEP_KEYS = {"step", "epoch", "loss", "acc", "lr", "train_time", "skipped"}
EPOCH_KEYS = {"epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc", "lr", "train_time", "eval_time"}
SUMMARY_KEYS = {"test_acc", "test_loss", "train_loss", "train_acc", "train_time", "eval_time", "epochs", "steps",
                "samples_per_s", "optimizer", "model", "dataset", "skipped_steps", "skipped_nonfinite_loss",
                "skipped_by_optimizer", "compile_time", "kl_clipped_steps", "stopped_by_max_steps", "resumed_at_steps",
                "out", "torch", "device_name", "threads"}


def _run(out: Path, data_dir: Path, *extra: str, plot: bool = False) -> dict[str, Any]:
    argv = ["--data-dir", str(data_dir), "--out", str(out), "--subset", "32", "--batch-size", "16",
            "--no-progress", *([] if plot else ["--no-plot"]), *extra]
    return T.run(argv)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _params(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / T.CHECKPOINT, map_location="cpu", weights_only=False)["model"]




@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model`` builds :func:`_tiny_cnn` (whatever its name)."""
    monkeypatch.setattr(T, "build_model", _tiny_cnn)


# --------------------------------------------------------------------------- short runs


@pytest.mark.parametrize("optimizer", ["sgd", "tengrad", *REGISTRY_OPTIMIZERS])
def test_two_steps(optimizer: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if optimizer in REGISTRY_OPTIMIZERS:
        monkeypatch.setattr(T, "build_model", _tiny_cnn)
    out = tmp_path / optimizer
    summary = _run(out, data_dir, "--optimizer", optimizer, "--epochs", "2", "--max-steps", "2")
    assert summary["steps"] == 2 and summary["stopped_by_max_steps"] and summary["epochs"] == 1
    assert summary["skipped_steps"] == 0
    assert np.isfinite(summary["test_loss"]) and 0 <= summary["test_acc"] <= 1
    steps = _jsonl(out / "steps.jsonl")
    assert [s["step"] for s in steps] == [1, 2]
    assert all(np.isfinite(s["loss"]) for s in steps)
    cfg = json.loads((out / "config.json").read_text())
    defaults = T._paper_defaults(optimizer, "fashion-mnist", "3c1f")
    assert cfg["lr"] == defaults["lr"] and cfg["weight_decay"] == defaults["weight_decay"]
    assert steps[0]["lr"] == defaults["lr"]
    if optimizer == "sgd":
        assert cfg["damping"] is None and not (out / "coverage.txt").exists()
    else:
        assert cfg["damping"] == defaults["damping"]
        assert "covered" in (out / "coverage.txt").read_text()


@pytest.mark.parametrize("optimizer", ["tengrad", "kfac", "ekfac"])
def test_mc_fisher(optimizer: str, data_dir: Path, tmp_path: Path, tiny: None) -> None:
    out = tmp_path / optimizer
    summary = _run(out, data_dir, "--optimizer", optimizer, "--fisher", "mc", "--max-steps", "2", "--epochs", "2")
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0 and np.isfinite(summary["test_loss"])
    assert json.loads((out / "config.json").read_text())["optimizer_kwargs"]["fisher"] == "mc"


def test_logs_have_documented_columns(data_dir: Path, tmp_path: Path, tiny: None) -> None:
    out = tmp_path / "run"
    summary = _run(out, data_dir, "--optimizer", "sgd", "--epochs", "2", "--eval-every", "3", plot=True)
    steps = _jsonl(out / "steps.jsonl")
    epochs = _jsonl(out / "epochs.jsonl")
    evals = _jsonl(out / "evals.jsonl")
    assert all(set(s) == STEP_KEYS for s in steps)
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and [s["epoch"] for s in steps] == [1, 1, 2, 2]
    times = [s["train_time"] for s in steps]
    assert all(b > a for a, b in zip(times, times[1:]))  # cumulative
    assert all(set(e) == EPOCH_KEYS for e in epochs)
    assert [e["epoch"] for e in epochs] == [1, 2] and [e["step"] for e in epochs] == [2, 4]
    assert epochs[0]["train_loss"] == pytest.approx(np.mean([s["loss"] for s in steps[:2]]))
    assert epochs[1]["train_acc"] == pytest.approx(np.mean([s["acc"] for s in steps[2:]]))
    assert epochs[1]["train_time"] == steps[-1]["train_time"]
    assert [e["step"] for e in evals] == [3] and set(evals[0]) == {"step", "epoch", "test_loss", "test_acc",
                                                                   "train_time", "eval_time"}
    assert set(summary) == SUMMARY_KEYS
    assert json.loads((out / "summary.json").read_text()) == summary
    assert summary["epochs"] == 2 and summary["steps"] == 4 and not summary["stopped_by_max_steps"]
    assert summary["test_acc"] == epochs[-1]["test_acc"] and summary["train_time"] == steps[-1]["train_time"]
    cfg = json.loads((out / "config.json").read_text())
    for key in ("model", "dataset", "optimizer", "epochs", "batch_size", "lr", "momentum", "weight_decay", "damping",
                "curvature_every", "fisher", "lr_schedule", "seed", "device", "compile", "subset", "max_steps",
                "out", "resume", "data_dir", "eval_every", "threads", "n_params", "steps_per_epoch"):
        assert key in cfg, key
    assert cfg["lr_schedule"] == "const" and cfg["steps_per_epoch"] == 2 and cfg["n_train"] == 32
    try:
        import tengrad_fx.cli.plot  # noqa: F401
    except ImportError:
        return
    assert (out / "curves.png").stat().st_size > 0


def test_tengrad_defaults_resolved(data_dir: Path) -> None:
    """The paper's TENGraD: tuned values, MC Fisher, curvature every 100 steps, KL clip 0.01."""
    args = T.build_parser().parse_args([])
    cfg = T.resolve_config(args)
    assert (cfg["lr"], cfg["weight_decay"], cfg["damping"]) == (0.003, 0.001, 0.1)
    assert (cfg["curvature_every"], cfg["fisher"], cfg["kl_clip"], cfg["lr_schedule"]) == (100, "mc", 0.01, "const")
    assert cfg["out"] == str(Path("runs") / "3c1f-fashion-mnist-tengrad-s0")
    assert cfg["device"] in ("cpu", "cuda")
    cfg = T.resolve_config(T.build_parser().parse_args(["--dataset", "CIFAR-100", "--optimizer", "sgd"]))
    assert (cfg["lr"], cfg["weight_decay"], cfg["damping"], cfg["kl_clip"]) == (0.01, 0.003, None, None)
    assert cfg["lr_schedule"] == "multistep:30,45:0.1"
    # the model picks the appendix row; a model without one takes wrn-28-4's, and says so
    cfg = T.resolve_config(T.build_parser().parse_args(["--dataset", "cifar10", "--model", "densenet-19"]))
    assert (cfg["lr"], cfg["weight_decay"], cfg["damping"]) == (0.1, 0.003, 0.2)
    cfg = T.resolve_config(T.build_parser().parse_args(["--dataset", "cifar100", "--model", "timm:resnet18"]))
    assert (cfg["lr"], cfg["damping"]) == (0.01, 0.3) and "no row for timm:resnet18" in cfg["defaults_from"]
    cfg = T.resolve_config(T.build_parser().parse_args(["--optimizer", "kfac", "--kl-clip", "0"]))
    assert cfg["kl_clip"] is None and cfg["fisher"] == "mc"
    assert T.optimizer_kwargs(cfg)["curvature_every"] == 20


def test_lr_schedules() -> None:
    assert [T.lr_factor("const", e) for e in (0, 5, 100)] == [1.0, 1.0, 1.0]
    assert [T.lr_factor("step:10:0.5", e) for e in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    assert [T.lr_factor("multistep:30,45:0.1", e) for e in (0, 29, 30, 44, 45)] == pytest.approx(
        [1.0, 1.0, 0.1, 0.1, 0.01])


# --------------------------------------------------------------------------- checkpoint and resume


@pytest.mark.parametrize("optimizer", ["sgd", "tengrad"])
def test_resume_is_bit_identical(optimizer: str, data_dir: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """1 epoch, then --resume to 2 epochs (TENGraD also stops inside epoch 2 and resumes
    again) == a straight 2-epoch run, bit for bit. TENGraD runs the real 3C1F, whose conv
    layers use materialized per-sample gradients (the capture store's choice is restored)."""
    if optimizer == "sgd":
        monkeypatch.setattr(T, "build_model", _tiny_cnn)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # curvature every step (bit-identical resume; with T > 1 the first step after loading recomputes it)
    opt = ["--optimizer", optimizer, *(["--curvature-every", "1"] if optimizer == "tengrad" else [])]
    _run(straight, data_dir, *opt, "--epochs", "2")
    _run(resumed, data_dir, *opt, "--epochs", "1")
    if optimizer == "tengrad":  # also stop and resume inside an epoch
        s = _run(resumed, data_dir, *opt, "--epochs", "2", "--max-steps", "3", "--resume")
        assert s["steps"] == 3 and s["stopped_by_max_steps"] and s["epochs"] == 1.5
    summary = _run(resumed, data_dir, *opt, "--epochs", "2", "--resume")
    a, b = _params(straight), _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = _jsonl(straight / "steps.jsonl"), _jsonl(resumed / "steps.jsonl")
    assert [s["step"] for s in sb] == [1, 2, 3, 4]
    assert [s["loss"] for s in sa] == [s["loss"] for s in sb]
    ea, eb = _jsonl(straight / "epochs.jsonl"), _jsonl(resumed / "epochs.jsonl")
    assert [e["epoch"] for e in eb if float(e["epoch"]).is_integer()] == [1, 2]
    assert ea[-1]["test_loss"] == eb[-1]["test_loss"] and ea[-1]["train_loss"] == eb[-1]["train_loss"]
    assert summary["steps"] == 4 and summary["epochs"] == 2
    assert summary["resumed_at_steps"] == ([2, 3] if optimizer == "tengrad" else [2])


def test_resume_refuses_a_different_config(data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           tiny: None) -> None:
    out = tmp_path / "run"
    _run(out, data_dir, "--optimizer", "sgd", "--max-steps", "1")
    with pytest.raises(SystemExit) as exc:
        _run(out, data_dir, "--optimizer", "sgd", "--lr", "0.5", "--resume")
    assert exc.value.code == 2
    assert "different configuration" in capsys.readouterr().err


def test_checkpoint_is_atomic(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny: None) -> None:
    out = tmp_path / "run"
    _run(out, data_dir, "--optimizer", "sgd", "--max-steps", "1")
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == []
    ckpt = torch.load(out / T.CHECKPOINT, map_location="cpu", weights_only=False)
    assert {"model", "optimizer", "epoch", "step", "batch_in_epoch", "rng", "train_time", "config"} <= set(ckpt)
    assert ckpt["step"] == 1 and ckpt["epoch"] == 0 and ckpt["batch_in_epoch"] == 1
    assert {"torch", "data_epoch_start"} <= set(ckpt["rng"])
    before = (out / T.CHECKPOINT).read_bytes()

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(T.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        T.save_checkpoint(out / T.CHECKPOINT, {"x": 1})
    assert (out / T.CHECKPOINT).read_bytes() == before  # the old checkpoint is untouched
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []


# --------------------------------------------------------------------------- errors and skips


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "adamw"], "invalid choice"),
    (["--model", "no-such-model"], "unknown model"),
    (["--dataset", "mnist-42"], "unknown dataset"),
    (["--lr-schedule", "cosine"], "bad --lr-schedule"),
    (["--optimizer", "sgd", "--damping", "0.1"], "does not apply"),
    (["--epochs", "0"], "--epochs must be >= 1"),
])
def test_bad_arguments_exit_cleanly(argv: list[str], message: str, data_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        T.run(["--data-dir", str(data_dir), "--out", str(tmp_path / "bad"), "--no-progress", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # nothing written for a run that never started


@pytest.mark.parametrize("argv, message", [
    (["--optimizer", "kfac", "--curvature-every", "5"], "PAPER_INTERVALS"),
    (["--optimizer", "kbfgs", "--fisher", "mc"], "--fisher does not apply"),
    (["--optimizer", "sgd", "--kl-clip", "0.1"], "--kl-clip does not apply"),
    (["--kl-clip", "-1"], "--kl-clip must be >= 0"),
])
def test_options_that_do_not_apply(argv: list[str], message: str) -> None:
    with pytest.raises(T.ConfigError, match=message):
        T.resolve_config(T.build_parser().parse_args(argv))


@pytest.mark.parametrize("optimizer", ["sgd", "tengrad"])
def test_nonfinite_loss_is_skipped_and_counted(optimizer: str, data_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, tiny: None) -> None:
    real = zoo.get_dataset

    def poisoned(name: str, split: str, *args: Any, **kwargs: Any) -> zoo.ArrayDataset:
        ds = real(name, split, *args, **kwargs)
        if split == "train":
            ds.x[:] = float("nan")
        return ds

    monkeypatch.setattr(zoo, "get_dataset", poisoned)
    out = tmp_path / "nan"
    summary = _run(out, data_dir, "--optimizer", optimizer, "--max-steps", "2")
    assert summary["skipped_steps"] == 2 and summary["skipped_nonfinite_loss"] == 2
    assert all(s["skipped"] for s in _jsonl(out / "steps.jsonl"))
    assert _jsonl(out / "epochs.jsonl")[-1]["train_loss"] is None  # no finite loss to average
    torch.manual_seed(0)  # the run's initial model: parameters must be unchanged
    init = _tiny_cnn("3c1f", None).state_dict()
    for k, v in _params(out).items():
        assert torch.equal(v, init[k]), k


def test_no_temp_files_and_rerun_overwrites(data_dir: Path, tmp_path: Path, tiny: None) -> None:
    out = tmp_path / "run"
    _run(out, data_dir, "--optimizer", "sgd", "--max-steps", "2")
    _run(out, data_dir, "--optimizer", "sgd", "--max-steps", "1")  # a fresh run replaces the old logs
    assert [s["step"] for s in _jsonl(out / "steps.jsonl")] == [1]
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())
    assert os.path.getsize(out / T.CHECKPOINT) > 0


def test_paper_tengrad_runs_mc_and_clips(data_dir: Path, tmp_path: Path, tiny: None) -> None:
    """No options: the paper's TENGraD, MC Fisher through ``opt.mc_capture`` in the loop (a
    missing call raises in ``step``) and the KL clip applied (counted by the optimizer).
    A large lr makes ``lr²·Σu·g`` exceed 0.01 on this tiny problem; ``--kl-clip 0`` turns it off."""
    out = tmp_path / "paper"
    summary = _run(out, data_dir, "--epochs", "2", "--max-steps", "3", "--lr", "0.5")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["fisher"] == "mc" and cfg["optimizer_kwargs"]["fisher"] == "mc"
    assert cfg["kl_clip"] == 0.01 and cfg["optimizer_kwargs"]["curvature_every"] == 100
    assert summary["skipped_steps"] == 0 and summary["kl_clipped_steps"] == 3
    off = _run(tmp_path / "off", data_dir, "--epochs", "2", "--max-steps", "3", "--lr", "0.5", "--kl-clip", "0")
    assert off["kl_clipped_steps"] == 0
    assert json.loads((tmp_path / "off" / "config.json").read_text())["optimizer_kwargs"]["kl_clip"] is None
