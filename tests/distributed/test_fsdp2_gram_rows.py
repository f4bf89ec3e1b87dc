"""``position_rows`` and ``curvature_samples`` under FSDP2 ``mode="gram-blocks"`` (gloo,
float64, 2 spawned ranks): each rank's part of the global batch's ``k`` rows is cut to every
rank's row shard (one all_to_all), the ``k × k`` Gram summed over the shard group; the
update is single-process ``TENGraD``'s with the same option on the concatenated batch
(``≤ 1e-10`` relative, every parameter, every step; the ranks agree bit for bit), and the
records a rank sends are its part of the ``k`` rows.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tengrad_fx.distributed.fsdp_rows import cut, cut_bias
from testing.fsdp_workers import SEQ, check_run, run_table

TOL = 1e-10

TWO: dict[str, dict[str, Any]] = {
    # the block: embedding tied to the head, attention, LayerNorms (one row per sample) beside the k rows
    "rows5-block-T1": dict(model="block", m=3, steps=4, T=1, mode="gram-blocks", opts=dict(position_rows=5)),
    "rows7-block-mc-T2": dict(model="block", m=3, steps=4, T=2, mode="gram-blocks", fisher="mc",
                              opts=dict(position_rows=7, metric="factored")),
    # transposed Linears (Conv1D): the weight's rows are input features, the bias sharded apart
    "rows3-conv1d-T1": dict(model="conv1d", m=3, steps=4, T=1, mode="gram-blocks", opts=dict(position_rows=3)),
    "rows5-gpt2-T1": dict(model="gpt2", m=2, steps=4, T=1, mode="gram-blocks", opts=dict(position_rows=5)),
    # layers recorded as per-sample gradients P (gathered: an added parameter, a bias-only layer) beside them
    "samples3-extras-layers-mc-T2": dict(model="mlp-extras", m=2, steps=4, T=2, fisher="mc", shard="layers",
                                         mode="gram-blocks", opts=dict(curvature_samples=3)),
    "samples4-block-T2": dict(model="block", m=3, steps=4, T=2, mode="gram-blocks", opts=dict(curvature_samples=4)),
    "samples2-cnn-layers-T1": dict(model="cnn", m=3, steps=4, T=1, shard="layers", mode="gram-blocks",  # rank 1: none
                                   opts=dict(curvature_samples=2, relative_damping=True)),
    # the bytes of a curvature step (step 0) less a reuse step's (step 1), with k = 5 of the 24 rows and without
    "bytes-rows5": dict(model="block", m=3, steps=2, T=2, mode="gram-blocks", opts=dict(position_rows=5)),
    "bytes-full": dict(model="block", m=3, steps=2, T=2, mode="gram-blocks"),
}
PER_SAMPLE = {"mlp-extras": {"pos", "fc2"}}  # the layers recorded as per-sample gradients, by model
ROWS = {"bytes-rows5": 5}  # k of the bytes runs
LINEAR = {"block.q", "block.k", "block.v", "block.o", "block.fc1", "block.fc2", "head"}  # the layers taking k rows


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_gram_rows"), 2, TWO)


@pytest.mark.parametrize("name", [k for k in TWO if not k.startswith("bytes")])
def test_gram_blocks_rows_equal_global_batch(two: dict[str, list[dict[str, Any]]], name: str) -> None:
    """Every layer cut to the row shards (but those recorded as per-sample gradients: gathered),
    and the update the global batch's."""
    plan = two[name][0]["plan"]
    assert {n for n, v in plan.items() if v["mode"] != "gram-blocks"} == PER_SAMPLE.get(TWO[name]["model"], set())
    check_run(TWO[name], two[name], TOL)


def test_position_rows_cut_records_are_k_rows(two: dict[str, list[dict[str, Any]]]) -> None:
    """The records a rank sends per layer on a curvature step (less the ``k × k`` Gram's
    all_reduce, ``2(S−1)/S·k²`` values): a rank holding ``r`` of the global batch's rows sends
    ``r`` rows of its cut for the other rank's shard, so, with ``w`` the bytes per row it sends
    without the option (``W·m·S = 24`` rows: ``m·S = 12`` held), the ranks' rows add up to
    ``k = 5`` for the layers that take position rows; the norm layers keep their ``m`` rows
    per sample (bytes unchanged)."""
    S, es, k = 2, 8, ROWS["bytes-rows5"]  # shards, float64 bytes

    def records(name: str, gram_rows: int) -> list[dict[str, int]]:
        gram = 2 * (S - 1) * gram_rows * gram_rows * es // S
        return [{n: r["comm"][0][n] - r["comm"][1][n] - gram for n in r["comm"][0]} for r in two[name]]
    full = records("bytes-full", 2 * 3)  # the Gram of the W·m samples
    rows, norm = records("bytes-rows5", k), records("bytes-rows5", 2 * 3)
    assert LINEAR < rows[0].keys() == full[0].keys()
    held = 3 * SEQ  # m·S position rows per rank
    for n in LINEAR:
        assert all(0 < full[q][n] and 0 <= rows[q][n] < full[q][n] for q in range(2)), n
        taken = sum(rows[q][n] * held / full[q][n] for q in range(2))  # each rank's rows, added
        assert abs(taken - k) < 1e-9, (n, taken)
    others = [n for n in full[0] if n not in LINEAR]
    assert others and all(norm[q][n] == full[q][n] > 0 for n in others for q in range(2)), (norm, full)


@pytest.mark.parametrize("kind, transposed", [("layernorm", False), ("rmsnorm", False), ("linear", True),
                                              ("linear", False)])
def test_a_rank_holding_none_of_the_rows_cuts_empty_records(kind: str, transposed: bool) -> None:
    """A rank may hold none of the ``k`` rows (its records have 0 rows): its cut for each shard
    has 0 rows and the trailing shape of a cut of held rows (what the other ranks receive)."""
    g = torch.Generator().manual_seed(0)
    I, G = torch.randn(3, 4, 6, generator=g), torch.randn(3, 4, 6, generator=g)
    spec = SimpleNamespace(weight=torch.zeros(6), transposed=transposed)
    for a, b in ((0, 3), (3, 6)):
        for whole, none in zip(cut(kind, spec, I, G, a, b, 6), cut(kind, spec, I[:0], G[:0], a, b, 6)):
            assert none.shape == (0, *whole.shape[1:]), (kind, none.shape, whole.shape)
        if transposed:
            assert cut_bias(kind, G[:0], a, b).shape == (0, *cut_bias(kind, G, a, b).shape[1:]) == (0, b - a)
