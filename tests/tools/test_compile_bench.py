"""``python -m tools.compile_bench`` runs both step kinds of both models and reports ratios."""
from __future__ import annotations

import argparse

from testing.repo_tools import tool

compile_bench = tool("compile_bench")


def test_compile_bench_reports_both_step_kinds() -> None:
    args = argparse.Namespace(model="tiny", m=4, T=2, steps=2, fisher="mc", device="cpu", threads=0, json=None)
    out = compile_bench.run(args)
    assert out["compile_s"] > 0
    for kind in ("curvature", "reuse"):
        assert out[kind]["eager_ms"] > 0 and out[kind]["compiled_ms"] > 0 and out[kind]["ratio"] > 0
    assert out["amortized_ratio"] > 0
