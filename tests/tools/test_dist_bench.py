"""``python -m tools.bench --distributed N`` (2 gloo ranks, the tiny model, 1 measured step)
and the analytic model of ``tools.dist_model``."""
from __future__ import annotations

import pytest

from testing.repo_tools import tool

METHODS, report_distributed, run_distributed = (getattr(tool("dist_bench"), n)
                                                for n in ("METHODS", "report_distributed", "run_distributed"))
model_table = tool("dist_model").model_table


def test_distributed_bench_reports_every_method() -> None:
    ranks = run_distributed(2, "tiny", 4, steps=1, warmup=1)
    text = report_distributed(ranks, 2, "tiny", 4)
    for meth in METHODS:
        assert meth in text
    res = ranks[0]["results"]
    assert res["ddp-sgd"]["tengrad_bytes"] == 0 and res["ddp-sgd"]["ddp_bytes"] > 0
    # owners send records or u; the local-Fisher mode all-reduces u (2·(W−1)/W·n·4 = n·4 bytes here)
    assert all(rk["results"]["dist-tengrad"]["tengrad_bytes"] > 0 for rk in ranks)
    n_cov = ranks[0]["results"]["dist-tengrad-local"]["tengrad_bytes"]
    assert n_cov == pytest.approx(4 * ranks[0]["n_params"], rel=0.01)
    assert 1e-6 < ranks[0]["local_error"] < 10.0  # the local Fisher is another preconditioner
    assert "relative difference" in text and "by layer and mode" in text and "x DDP-SGD" in text
    # gram-blocks: records on curvature steps; on reuse steps only m- and M-vectors and the Jᵀc all-reduce
    reuse = ranks[0]["per_layer"][("gram-blocks", "reuse")]
    n = ranks[0]["layer_n"]
    assert set(reuse) == set(n) and all(reuse[k] == (4 + 8 + n[k]) * 4 for k in n)  # W=2, m=4, float32
    assert set(ranks[0]["auto"].values()) <= {"gather", "gram-blocks"} and set(ranks[0]["auto"]) == set(n)


def test_dist_model_rows() -> None:
    layers = [{"name": "a", "n": 1000, "r": 500, "dims": (1, 1, 99, 10)},
              {"name": "b", "n": 10, "r": 20, "dims": (1, 1, 9, 1)}]
    rows = model_table(layers, [2, 4], m=8, T=10, bandwidth=1e9, flop_rate=1e12)
    assert [r["M"] for r in rows] == [16, 32]
    assert rows[0]["ddp_MB"] == pytest.approx(2 * 1 / 2 * 1010 * 4 / 2**20)
    assert rows[1]["gram_GiB"] == pytest.approx(32 * 32 * 4 / 2**30)
    assert all(r["affordable"] for r in rows)
