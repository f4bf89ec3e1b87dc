"""``examples/fsdp2_train.py --smoke`` on 2 spawned gloo ranks (as under torchrun): every
rank's losses are finite and go down, and its checkpoint round trip through
torch.distributed.checkpoint completes."""
from __future__ import annotations

from pathlib import Path

import torch

from testing.distributed import run_ranks
from testing.fsdp_workers import run_example


def test_fsdp2_example_smoke(tmp_path: Path) -> None:
    res = run_ranks(run_example, 2, tmp_path, ["--smoke"], timeout=300)
    for r in res:
        losses = torch.tensor(r["losses"])
        assert len(losses) == 4 and torch.isfinite(losses).all()
        assert losses[-1] < losses[0]
