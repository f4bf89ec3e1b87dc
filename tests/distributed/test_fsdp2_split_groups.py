"""``DistributedTENGraD`` under FSDP2 on grouped convolutions whose groups the shards split
(:class:`testing.fsdp_extras.SplitGroupsCNN`, 2 gloo ranks, float64): a Conv of 3 groups of 2
output channels (rank 0 holds group 0 and half of group 1) and a ConvTranspose of 3 groups of
2 input channels, split alike, give single-process ``TENGraD``'s update on the concatenated
batch at every step (``≤ 1e-10`` relative, every parameter), in both modes."""
from __future__ import annotations

from typing import Any

import pytest

from testing.fsdp_workers import check_run, run_table

TOL = 1e-10
TWO: dict[str, dict[str, Any]] = {
    "blocks-T1": dict(model="cnn-split", m=3, steps=4, T=1, shard="layers", mode="gram-blocks"),
    "gather-T2": dict(model="cnn-split", m=2, steps=4, T=2, shard="layers", mode="gather"),
}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_split_groups"), 2, TWO)


@pytest.mark.parametrize("name", list(TWO))
def test_split_groups_under_fsdp2_equal_global_batch(two: dict[str, list[dict[str, Any]]], name: str) -> None:
    cfg, ranks = TWO[name], two[name]
    assert {ranks[0]["plan"][n]["mode"] for n in ("c1", "t1")} == {cfg["mode"]}
    ref = check_run(cfg, ranks, TOL)
    assert {f"{n}.{p}" for n in ("c1", "t1") for p in ("weight", "bias")} <= ref[0].keys()
