"""``tengrad_fx.cli._dist.leave_if_destroyed``: a run that destroyed the process group it
created ends without the interpreter's teardown (no ``atexit`` handler runs, exit code 0,
buffered output flushed); any other run returns and exits as usual."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
from tengrad_fx.cli import _dist
atexit.register(lambda: print("teardown ran", flush=True))
if {destroyed}:
    _dist._DESTROYED = True
sys.stdout.write("outputs written\\n")  # buffered: must still come out
_dist.leave_if_destroyed()
print("returned", flush=True)
"""


@pytest.mark.parametrize("destroyed", [True, False])
def test_leave_if_destroyed(destroyed: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(destroyed=destroyed)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert "outputs" in lines
    assert ("teardown" in lines) is (not destroyed) and ("returned" in lines) is (not destroyed), proc.stdout


def test_close_marks_the_group_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DistRun.close`` sets the mark only when it destroyed a group."""
    import torch.distributed as dist

    from tengrad_fx.cli import _dist
    monkeypatch.setattr(_dist, "_DESTROYED", False)
    run = object.__new__(_dist.DistRun)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    run.close()
    assert _dist._DESTROYED is False
    calls: list[bool] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append(True))
    run.close()
    assert calls == [True] and _dist._DESTROYED is True
