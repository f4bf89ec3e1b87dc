"""``DistributedTENGraD`` under FSDP2 on transposed convolutions (weight ``[c_in, c_out/g, *k]``:
``fully_shard`` gives each rank rows of the input channels, and the bias's rows of the output
channels apart), gloo, float64: :class:`testing.fsdp_extras.TransposedCNN` (an ungrouped one
with uneven shards, one of 3 groups whose output channels and bias rows fall apart on 2 ranks,
one of 2 groups) gives single-process ``TENGraD``'s update on the concatenated batch at every
step (``≤ 1e-10`` relative, every parameter; the ranks agree bit for bit), in both modes, with
the MC Fisher, the KL clip and the factored metric. Under ``-m slow``: HSDP (2 × 2), and on 4
ranks the 2-group layer, whose groups ``fully_shard``'s 2-channel rows split (completed by zero
rows, :mod:`tengrad_fx.distributed.fsdp_rows`).
"""
from __future__ import annotations

from typing import Any

import pytest

from testing.fsdp_workers import check_run, run_table

TOL = 1e-10
TWO: dict[str, dict[str, Any]] = {
    "gather-T1": dict(model="tconv", m=3, steps=4, T=1, mode="gather"),
    "blocks-T2-clip": dict(model="tconv", m=3, steps=4, T=2, mode="gram-blocks", kl_clip=0.01),
    "layers-auto-mc-T1": dict(model="tconv", m=2, steps=4, T=1, shard="layers", fisher="mc"),
    "factored-blocks-T1": dict(model="tconv", m=2, steps=4, T=1, mode="gram-blocks",
                               opts=dict(metric="factored", relative_damping=True)),
}
FOUR: dict[str, dict[str, Any]] = {
    "hsdp-blocks-T2": dict(model="tconv", m=2, steps=4, T=2, mesh=(2, 2), mode="gram-blocks"),
    "hsdp-layers-gather-mc-T1": dict(model="tconv", m=2, steps=4, T=1, mesh=(2, 2), shard="layers", mode="gather",
                                     fisher="mc"),
    "4-blocks-T1": dict(model="tconv", m=2, steps=3, T=1, mode="gram-blocks"),  # t2's groups split
}




@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_tconv"), 2, TWO)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_tconv4"), 4, FOUR)


def _check(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    if "mode" in cfg:
        assert {v["mode"] for v in ranks[0]["plan"].values()} == {cfg["mode"]}
    ref = check_run(cfg, ranks, TOL)
    assert {f"t{i}.{p}" for i in range(3) for p in ("weight", "bias")} <= ref[0].keys()


@pytest.mark.parametrize("name", list(TWO))
def test_transposed_convolutions_under_fsdp2_equal_global_batch(two: dict[str, list[dict[str, Any]]],
                                                                name: str) -> None:
    _check(TWO[name], two[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FOUR))
def test_transposed_convolutions_under_hsdp_equal_global_batch(four: dict[str, list[dict[str, Any]]],
                                                               name: str) -> None:
    _check(FOUR[name], four[name])
