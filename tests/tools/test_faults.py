"""Killed runs and damaged checkpoints of ``tengrad_fx.cli.train``.

A child process (``python -m testing.faulty_train``: ``tengrad_fx.cli.train`` on a tiny CNN and
synthetic data) is ``kill -9``-ed at chosen moments -- inside an optimizer step, halfway
through writing a checkpoint, at the start of an evaluation -- then run again with
``--resume`` until it finishes. Its final parameters and its ``steps.jsonl`` /
``epochs.jsonl`` (every field but the wall-clock times) must equal an uninterrupted run's:
no line lost, none duplicated. SGD, and TENGraD with ``curvature_every`` = 3 (curvature
cached across the checkpoint). A truncated or corrupt ``checkpoint.pt`` is reported, kept
aside, and the run resumes from ``checkpoint.prev.pt``. The default run kills at fixed
moments; ``-m slow`` adds seeded random moments and kills after random delays.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from testing.faulty_train import tiny_cnn, write_fake_fmnist
from tengrad_fx.cli import train as T
from tengrad_fx.cli._checkpoint import PREVIOUS

ROOT = Path(__file__).resolve().parents[2]
TIMES = ("train_time", "eval_time")
EPOCHS = 3  # 64 images, batch 16: 4 steps per epoch, 12 steps


@pytest.fixture(autouse=True)
def _restore_threads():  # type: ignore[no-untyped-def]
    n = torch.get_num_threads()  # tengrad_fx.cli.train sets --threads for the whole process
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_fmnist(tmp_path_factory.mktemp("fmnist"))


def _args(out: Path, data_dir: Path, optimizer: str) -> list[str]:
    extra = ["--curvature-every", "3"] if optimizer == "tengrad" else []
    return ["--data-dir", str(data_dir), "--out", str(out), "--subset", "64", "--batch-size", "16",
            "--epochs", str(EPOCHS), "--optimizer", optimizer, "--threads", "1", "--no-progress",
            "--no-plot", *extra]


def _two_epochs(args: list[str]) -> list[str]:
    i = args.index("--epochs")
    return [*args[:i], "--epochs", "2", *args[i + 2:]]


def _reference(out: Path, data_dir: Path, optimizer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The uninterrupted run, in this process (same code and thread count as the child)."""
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    T.run(_args(out, data_dir, optimizer))


def _child(args: list[str], fault: str = "", kill_after: Optional[float] = None) -> bool:
    """Run the child; kill -9 it when it pauses at ``fault`` (or after ``kill_after``
    seconds). True if it was killed, False if it finished (it must then exit 0)."""
    env = dict(os.environ, FAULT_PAUSE=fault, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "testing.faulty_train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if kill_after is not None:
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
        elif fault:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("PAUSED"):
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return True
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        return False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMES} for x in path.read_text().splitlines()]


def _assert_same_run(a: Path, b: Path) -> None:
    for name in ("steps.jsonl", "epochs.jsonl"):
        ra, rb = _jsonl(a / name), _jsonl(b / name)
        assert [r["step"] for r in rb] == [r["step"] for r in ra], name  # no line lost or duplicated
        assert rb == ra, name
    pa = torch.load(a / T.CHECKPOINT, map_location="cpu", weights_only=False)["model"]
    pb = torch.load(b / T.CHECKPOINT, map_location="cpu", weights_only=False)["model"]
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert not list(b.glob(".*tmp")), "a killed save's temporary file was left behind"
    summary = json.loads((b / "summary.json").read_text())
    assert summary["steps"] == 4 * EPOCHS


def _killed_run(out: Path, data_dir: Path, optimizer: str, faults: list[str]) -> list[bool]:
    args = _args(out, data_dir, optimizer)
    killed = []
    for i, fault in enumerate(faults):
        killed.append(_child(args + (["--resume"] if i else []), fault))
    _child(args + ["--resume"])
    return killed


# (optimizer, faults): each fault kills one process, the next one resumes.
SCENARIOS = {
    "sgd": ["checkpoint:2", "eval:1", "step:2"],
    "tengrad": ["step:5", "checkpoint:1", "eval:2"],
}


@pytest.mark.parametrize("optimizer", sorted(SCENARIOS))
def test_killed_and_resumed_equals_uninterrupted(optimizer: str, data_dir: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    _reference(ref, data_dir, optimizer, monkeypatch)
    assert all(_killed_run(run, data_dir, optimizer, SCENARIOS[optimizer]))
    _assert_same_run(ref, run)
    assert (run / PREVIOUS).exists()  # the last two checkpoints are kept


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("optimizer", ["sgd", "tengrad"])
def test_killed_at_random_moments(optimizer: str, seed: int, data_dir: Path, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded random phases and occurrences, then kills after random delays."""
    rng = random.Random(seed)
    ref, run = tmp_path / "ref", tmp_path / "run"
    _reference(ref, data_dir, optimizer, monkeypatch)
    faults = [f"{rng.choice(['step', 'checkpoint', 'eval'])}:{rng.randint(1, 3)}" for _ in range(3)]
    args = _args(run, data_dir, optimizer)
    for i, fault in enumerate(faults):
        _child(args + (["--resume"] if i else []), fault)
    for _ in range(3):
        _child(args + ["--resume"], kill_after=rng.uniform(1.0, 8.0))
    _child(args + ["--resume"])
    _assert_same_run(ref, run)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_checkpoint_falls_back_to_previous(damage: str, data_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    _reference(ref, data_dir, "sgd", monkeypatch)
    args = _args(run, data_dir, "sgd")
    T.run(_two_epochs(args))  # 2 of 3 epochs
    ckpt = run / T.CHECKPOINT
    assert torch.load(run / PREVIOUS, weights_only=False)["step"] == 4
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 3] if damage == "truncated" else bytes(random.Random(0).randbytes(4096)))
    bad = ckpt.read_bytes()
    capsys.readouterr()
    T.run(args + ["--resume"])
    err = capsys.readouterr().err
    assert "checkpoint.pt is truncated or corrupt" in err and "checkpoint.prev.pt (step 4)" in err, err
    assert (run / "checkpoint.pt.corrupt").read_bytes() == bad  # kept aside for inspection
    _assert_same_run(ref, run)
    assert json.loads((run / "summary.json").read_text())["resumed_at_steps"] == [4]


def test_no_usable_checkpoint_is_a_clear_error(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(T, "build_model", tiny_cnn)
    run = tmp_path / "run"
    args = _args(run, data_dir, "sgd")
    T.run(_two_epochs(args))
    for name in (T.CHECKPOINT, PREVIOUS):
        (run / name).write_bytes(b"not a checkpoint")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        T.run(args + ["--resume"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "checkpoint.pt is truncated or corrupt" in err and "checkpoint.prev.pt is truncated or corrupt" in err
    assert "no usable checkpoint" in err and "without --resume" in err
    assert (run / T.CHECKPOINT).read_bytes() == b"not a checkpoint"  # nothing deleted


def test_stopped_between_the_two_renames(data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A save stopped between its two renames leaves checkpoint.prev.pt (the latest) and a
    temporary file: the run resumes from the former and removes the latter."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    _reference(ref, data_dir, "sgd", monkeypatch)
    args = _args(run, data_dir, "sgd")
    T.run(_two_epochs(args))
    os.replace(run / T.CHECKPOINT, run / PREVIOUS)  # the first rename of the next save
    (run / ".checkpoint.pt.abc123.tmp").write_bytes(b"half a checkpoint")  # its unrenamed new file
    capsys.readouterr()
    T.run(args + ["--resume"])
    assert "resuming from the previous checkpoint" in capsys.readouterr().err
    _assert_same_run(ref, run)
