"""``tengrad_fx.cli.train`` in a child process that a fault-injection test can ``kill -9`` at a
chosen moment, on a tiny CNN and synthetic Fashion-MNIST-shaped data.

    FAULT_PAUSE=checkpoint:2 python -m testing.faulty_train [tengrad_fx.cli.train arguments]

``FAULT_PAUSE="<phase>:<n>"`` makes the process stop at the ``n``-th (1-based) occurrence
of ``phase`` in this process, print ``PAUSED <phase> <n>`` on stdout and sleep until it
is killed:

* ``step``: inside ``opt.step()``, after the parameters (and momentum buffers) changed in
  memory, before the step is logged;
* ``checkpoint``: inside ``torch.save`` of a checkpoint, after half of its bytes reached
  the temporary file;
* ``eval``: at the start of an evaluation (end of an epoch).

Without ``FAULT_PAUSE`` it is a plain run (``tengrad_fx.cli.train.run``) of the tiny CNN.
"""
from __future__ import annotations

import gzip
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

__all__ = ["tiny_cnn", "write_fake_fmnist", "install"]


def tiny_cnn(name: str, dataset: Any) -> nn.Module:
    """A 2-layer CNN for 28×28 inputs (whatever ``--model`` says)."""
    return nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 7 * 7, 16), nn.ReLU(), nn.Linear(16, 10))


def _write_idx(path: Path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def write_fake_fmnist(d: Path, n_train: int = 64, n_test: int = 32, seed: int = 0) -> Path:
    """Random Fashion-MNIST-shaped IDX files in ``d`` (a ``--data-dir``)."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(d / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _write_idx(d / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    return d


def _pause(phase: str) -> None:
    print(f"PAUSED {phase}", flush=True)
    while True:
        time.sleep(60)


def install(fault: str) -> None:
    """Patch ``tengrad_fx.cli.train`` / ``tengrad_fx.cli._loop``: the tiny CNN, and the pause of ``fault``
    (``"<phase>:<n>"`` or ``""``)."""
    from tengrad_fx.cli import _loop
    from tengrad_fx.cli import train as T

    T.build_model = tiny_cnn
    phase, _, n = fault.partition(":")
    target = int(n) if n else 0
    count = {"step": 0, "checkpoint": 0, "eval": 0}

    def hit(p: str) -> bool:
        count[p] += 1
        return p == phase and count[p] == target

    build = T.build_optimizer

    def build_optimizer(cfg: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
        opt = build(cfg, model)
        step = opt.step

        def paused_step(*args: Any, **kwargs: Any) -> Any:
            out = step(*args, **kwargs)
            if hit("step"):
                _pause(f"step {target}")
            return out

        opt.step = paused_step  # type: ignore[method-assign]
        return opt

    T.build_optimizer = build_optimizer
    save = torch.save

    def paused_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if not hit("checkpoint"):
            return save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        _pause(f"checkpoint {target}")

    _loop.torch.save = paused_save  # type: ignore[assignment]
    evaluate = _loop.evaluate

    def paused_evaluate(*args: Any, **kwargs: Any) -> Any:
        if hit("eval"):
            _pause(f"eval {target}")
        return evaluate(*args, **kwargs)

    _loop.evaluate = paused_evaluate  # type: ignore[assignment]


def main() -> None:
    install(os.environ.get("FAULT_PAUSE", ""))
    from tengrad_fx.cli import train as T

    T.run(sys.argv[1:])


if __name__ == "__main__":
    main()
