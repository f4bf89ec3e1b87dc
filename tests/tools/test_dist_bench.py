"""``python -m tools.bench --distributed N`` (2 gloo ranks, the tiny model, 1 measured step)
and the analytic model of ``tools.dist_model``."""
from __future__ import annotations

import json
from typing import Any

import pytest

from testing.repo_tools import tool

METHODS, method_list, report_distributed, run_distributed, to_json = (
    getattr(tool("dist_bench"), n) for n in ("METHODS", "method_list", "report_distributed", "run_distributed",
                                             "to_json"))
model_table = tool("dist_model").model_table
build_model = tool("dist_bench").build_model


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(2, "tiny", 4, steps=1, warmup=1)


def test_distributed_bench_reports_every_method(ranks: list[dict[str, Any]]) -> None:
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


def test_distributed_bench_optimizer_memory(ranks: list[dict[str, Any]]) -> None:
    """Momentum is one parameter-sized buffer per parameter: whole under DDP, the local
    shard (about 1/W) under FSDP2; only TENGraD keeps curvature."""
    model, _ = build_model("tiny")
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    momentum = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    text = report_distributed(ranks, 2, "tiny", 4)
    assert "state MB/rank" in text and "curvature MB/rank" in text
    for rk in ranks:
        assert rk["param_bytes"] == full
        res = rk["results"]
        for meth in ("ddp-sgd", "dist-tengrad", "dist-tengrad-blocks", "dist-tengrad-T20"):
            assert res[meth]["state_bytes"] / full == pytest.approx(momentum / full, abs=0.05)
        for meth in ("fsdp-sgd", "fsdp-tengrad", "fsdp-tengrad-blocks", "fsdp-tengrad-T20"):
            assert 0.3 < res[meth]["state_ratio"] <= 0.6
        assert res["ddp-sgd"]["curvature_bytes"] == 0 and res["fsdp-sgd"]["curvature_bytes"] == 0
        assert all(res[meth]["curvature_bytes"] > 0 for meth in METHODS if "tengrad" in meth)
    # FSDP2 shards the momentum: the ranks' state adds up to the whole parameters
    assert sum(rk["results"]["fsdp-tengrad"]["state_bytes"] for rk in ranks) == pytest.approx(momentum, rel=0.01)
    back = json.loads(json.dumps(to_json(ranks)))
    assert back[0]["results"]["fsdp-tengrad"]["state_bytes"] == ranks[0]["results"]["fsdp-tengrad"]["state_bytes"]
    assert "gram-blocks/reuse" in back[0]["per_layer"]


def test_distributed_method_list() -> None:
    assert method_list(None) == list(METHODS)
    assert method_list("fsdp-tengrad,dist-tengrad") == ["ddp-sgd", "dist-tengrad", "fsdp-tengrad"]
    with pytest.raises(ValueError, match="unknown distributed method"):
        method_list("ddp-sgd,fsdp-adam")


def test_dist_model_rows() -> None:
    layers = [{"name": "a", "n": 1000, "r": 500, "dims": (1, 1, 99, 10)},
              {"name": "b", "n": 10, "r": 20, "dims": (1, 1, 9, 1)}]
    rows = model_table(layers, [2, 4], m=8, T=10, bandwidth=1e9, flop_rate=1e12)
    assert [r["M"] for r in rows] == [16, 32]
    assert rows[0]["ddp_MB"] == pytest.approx(2 * 1 / 2 * 1010 * 4 / 2**20)
    assert rows[1]["gram_GiB"] == pytest.approx(32 * 32 * 4 / 2**30)
    assert all(r["affordable"] for r in rows)
