"""``DistributedTENGraD`` under FSDP2 on Hugging Face's transposed Linear (``Conv1D``,
weight ``[d_in, d_out]``: ``fully_shard`` gives each rank rows of the input features, and
the bias's rows of the output features apart), 2 gloo ranks, float64: every parameter's
change at every step equals single-process ``TENGraD``'s on the concatenated batch to
``≤ 1e-10`` (relative), in both modes; a tiny ``GPT2LMHeadModel`` (its ``Conv1D``
attention and MLP, LayerNorms, position embedding, token embedding tied to the head)
likewise. One spawn runs every configuration.
"""
from __future__ import annotations

from typing import Any

import pytest

from testing.fsdp_workers import assert_follows_reference, run_table, train_reference

pytest.importorskip("transformers")

TOL = 1e-10
RUNS = {
    "conv1d-gather-T1": dict(model="conv1d", m=3, steps=3, T=1, mode="gather"),
    "conv1d-blocks-T2-clip": dict(model="conv1d", m=3, steps=3, T=2, mode="gram-blocks", kl_clip=0.01),
    "gpt2-gather-T1": dict(model="gpt2", m=2, steps=3, T=1, mode="gather"),
    "gpt2-blocks-T1": dict(model="gpt2", m=2, steps=3, T=1, mode="gram-blocks"),
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_conv1d"), 2, RUNS)


@pytest.mark.parametrize("name", list(RUNS))
def test_conv1d_under_fsdp2_equals_global_batch(ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    cfg, got = RUNS[name], ranks[name]
    assert got[0]["type"] == "FSDPTENGraD"
    assert got[0]["counters"] == {"step": cfg["steps"], "skipped": 0, "uncaptured": 0}
    assert {v["mode"] for v in got[0]["plan"].values()} == {cfg["mode"]}
    ref = train_reference(cfg, 2)
    traj = got[0]["traj"]
    assert traj[0].keys() == ref[0].keys()
    assert any(n.startswith("c1.") or "c_attn" in n for n in ref[0])  # a Conv1D is optimized
    assert_follows_reference(got, ref, cfg["steps"], TOL)
