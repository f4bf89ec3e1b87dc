"""``examples/lm_fsdp2.py --smoke`` under ``torchrun`` on 2 gloo ranks (CPU), per ``--setting``:
the byte-level GPT-2 trains (finite losses that go down) and the run resumed from its DCP
checkpoint equals the uninterrupted one bit for bit (the example raises otherwise), with the
setting's metric, position rows (``lm``) and MC Fisher.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _torchrun(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``torchrun --standalone --nproc-per-node 2 examples/lm_fsdp2.py --smoke ARGS`` on the
    repository's documentation as the text; the process and rank 0's JSON path."""
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "lm_fsdp2.py"), "--smoke", "--text", str(ROOT / "docs" / "design.md"),
           "--out", str(out), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.parametrize("setting", ["lm", "polar"])
def test_lm_fsdp2_smoke(setting: str, tmp_path: Path) -> None:
    proc, out = _torchrun(["--setting", setting], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "resumed run equals the uninterrupted one bit for bit" in proc.stdout
    result = json.loads(out.read_text())
    losses = torch.tensor(result["losses"])
    assert result["resumed_equal"] is True and len(losses) == 6 and torch.isfinite(losses).all()
    assert losses[-2:].sum() < losses[:2].sum(), losses
    assert result["val_loss"] < 5.55  # below ln 256, the loss of uniform bytes
