"""Smoke test of ``tools.bench`` on the ``tiny`` proxy: rows, amortized T=100 ratio, the reuse
step's flops/bytes, and the machine-independent facts of ``--ops`` (0 host syncs)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from testing.repo_tools import tool

bench = tool("bench")


def test_bench_tiny_paper_rows_with_ops(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.json"
    bench.main(["--model", "tiny", "--m", "4", "--steps", "2", "--warmup", "1", "--methods", "paper",
                "--ops", "--json", str(out), "--malloc", "default"])  # (steady: for this whole process)
    res = json.loads(out.read_text())
    assert res["threads"] == 1 and res["m"] == 4 and res["malloc"] == "default"
    rows = res["results"]
    assert list(rows) == ["sgd", "tengrad", "tengrad-mc", "tengrad-mc-T100"]
    t100 = rows["tengrad-mc-T100"]
    assert t100["reuse"] == 1.0 and t100["reuse_gflop"] > 0 and t100["reuse_mb"] > 0
    amortized = (rows["tengrad-mc"]["total"] + 99 * t100["total"]) / 100
    assert abs(t100["ratio_to_sgd"] - amortized / rows["sgd"]["total"]) < 1e-9
    kinds = {(r["method"], r["kind"]): r for r in res["ops"]}
    assert ("tengrad-mc-T100", "reuse") in kinds and ("tengrad", "curvature") in kinds
    for (_meth, _), r in kinds.items():
        assert r["syncs"] == 0, r
        assert r["kernels"] <= r["ops"]
    assert kinds[("tengrad-mc-T100", "reuse")]["kernels"] < kinds[("tengrad-mc", "curvature")]["kernels"]
    printed = capsys.readouterr().out
    assert "x SGD" in printed and "host syncs" in printed


def test_conv_method_rows_run_under_their_method(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``tengrad-grouped`` / ``tengrad-unfold`` compute the per-sample conv gradients of
    their steps by that method; the default row by the rule (``auto``), in one process."""
    from tengrad_fx.capture import per_sample_conv as psc
    seen: dict[str, set[str]] = {}
    real = psc.per_sample_conv_weight_grads

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        seen.setdefault(current[0], set()).add(psc.PER_SAMPLE_CONV)
        return real(*a, **k)

    current = [""]
    monkeypatch.setattr(psc, "per_sample_conv_weight_grads", spy)
    from tengrad_fx.capture import ops
    monkeypatch.setattr(ops, "per_sample_conv_weight_grads", spy)
    import torch
    model, shape = bench.build_model("tiny")
    x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    for meth in ("tengrad", "tengrad-grouped", "tengrad-unfold"):
        current[0] = meth
        r = bench.Runner(meth, model, x)
        for _ in range(2):
            r.step(x, y, lambda: None)
    assert seen == {"tengrad": {"auto"}, "tengrad-grouped": {"grouped"}, "tengrad-unfold": {"unfold"}}
    assert psc.PER_SAMPLE_CONV == "auto"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_bench_keeps_the_heap_steady_by_default(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On Linux (glibc) a CPU bench run first applies :func:`tools.bench.steady_malloc`
    (every ``mallopt`` accepted) and says so; in its own process (it lasts for the process)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "tools.bench", "--model", "tiny", "--m", "4", "--steps", "1",
                           "--warmup", "1", "--methods", "sgd", "--json", str(out)],
                          stdout=subprocess.PIPE, text=True, check=True, cwd=Path(__file__).parents[2])
    assert json.loads(out.read_text())["malloc"] == "steady"
    assert "malloc=steady" in proc.stdout
