"""Smoke test of ``tools.gram_bench`` at a tiny batch (skip logic, table, JSON)."""
from __future__ import annotations

import json

from testing.repo_tools import tool

gram_bench = tool("gram_bench")


def test_gram_bench_small(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.json"
    gram_bench.main(["--m", "2", "--threads", "1", "--repeats", "1", "--max-gflop", "1",
                     "--json", str(out)])
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [r["kind"] for r in res["layers"]] == ["conv2d"] * 3 + ["linear"] * 2
    conv2 = res["layers"][1]
    assert conv2["dims"] == [1, 784, 1152, 128]
    assert conv2["ms"]["factor"] is None and conv2["skipped"]["factor"].startswith("skipped: est.")
    assert conv2["ms"]["materialize"] is not None
    fc = res["layers"][3]
    # float32; materialize sums 5·10⁶ products
    assert fc["auto"] == "factor" and fc["ms"]["factor"] is not None and fc["rel_diff"] < 1e-3
    assert "skipped: est." in text and "plain forward+backward" in text


def test_gram_bench_decoder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench.json"
    gram_bench.main(["--model", "decoder", "--m", "2", "--threads", "1", "--repeats", "1",
                     "--json", str(out)])
    res = json.loads(out.read_text())
    assert [r["kind"] for r in res["layers"]] == ["conv_transpose2d"] * 3 + ["conv2d"]
    # transposed: S = input positions, f = (c_out/g)·Πk, o = c_in/g
    assert res["layers"][1]["dims"] == [1, 8 * 8, 64 * 16, 128]
    assert all(r["rel_diff"] < 1e-4 for r in res["layers"])  # both strategies give one Gram
