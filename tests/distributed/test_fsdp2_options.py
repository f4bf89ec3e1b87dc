"""TENGraD's curvature options under FSDP2 (``fully_shard``, gloo, float64, spawned ranks):
with each, ``DistributedTENGraD`` on the sharded model gives single-process ``TENGraD``'s
update on the concatenated global batch (``≤ 1e-10`` relative, every parameter, every
step; the ranks agree bit for bit). One spawn per world size runs every configuration;
4 ranks run HSDP (a 2 × 2 mesh) too.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from tengrad_fx import Metric
from testing.fsdp_workers import check_run, run_table

TOL = 1e-10

TWO: dict[str, dict[str, Any]] = {
    "relative-gather-T2": dict(model="block", m=3, steps=4, T=2, mode="gather", opts=dict(relative_damping=True)),
    "relative-cnn-blocks-T1-woodbury": dict(model="cnn", m=2, steps=3, T=1, mode="gram-blocks", shard="layers",
                                      opts=dict(relative_damping=True, update_form="woodbury")),
    # compile=True: the distributed steps run unfused (FSDPShards.fuses is False): compile=False's update
    "compile-auto-T2": dict(model="block", m=3, steps=4, T=2, fisher="mc", reference=dict(compile=False),
                            opts=dict(compile=True)),
    "factored-gather-T1": dict(model="block", m=3, steps=3, T=1, mode="gather",
                               opts=dict(metric=Metric("factored", beta2=0.9))),
    "factored-blocks-T2-clip": dict(model="block", m=2, steps=4, T=2, mode="gram-blocks", kl_clip=0.01,
                                    opts=dict(metric="factored", relative_damping=True)),
    # Kronecker on the MLP (uneven row shards of full S_L): the block's attention grows rounding through
    # the inverse roots of nearly degenerate L, R past 1e-10 within 4 steps on one process's own inputs too
    "kronecker-mlp-gather-T2": dict(model="mlp", m=3, steps=4, T=2, mode="gather",
                                    opts=dict(metric=Metric("kronecker", beta2=0.9))),
    # damping 2: with 2 samples per rank the first steps' moments L, R have rank <= 4, below their sides,
    # so D = L^1/2 (x) R^1/2 spans 1e6 (FLOOR on each side) and its eigenvalues just above the floor move
    # by ~1e-10 (relative) when the batch's sums are reordered. At damping 0.05 the step along D's small
    # directions (~1/(alpha D)) carries that and the steps grow it ~7x each (one process with its batch
    # permuted: 1e-11, 3e-11, 8e-11, 6e-10); at 2 (relative: twice the scaled Gram's mean eigenvalue;
    # the Fisher still turns the first step by 0.2-0.5 from the metric's own) it stays <= 4e-11 for 6
    # steps, and this run within 1e-11 of one process's
    "kronecker-mlp-blocks-mc-T1": dict(model="mlp", m=2, steps=4, T=1, mode="gram-blocks", fisher="mc",
                                       opts=dict(metric="kronecker", relative_damping=True, damping=2.0)),
    "kronecker-conv1d-auto-T1": dict(model="conv1d", m=3, steps=3, T=1, opts=dict(metric="kronecker")),
    "factored-conv1d-blocks-T1": dict(model="conv1d", m=3, steps=3, T=1, mode="gram-blocks",
                                      opts=dict(metric="factored")),
    # fisher="mc" and "gauss-newton" with fully_shard on every layer: the backwards to unsharded weights
    "mc-mlp-layers-T1": dict(model="mlp", m=3, steps=3, T=1, fisher="mc", shard="layers"),
    "gn-mlp-layers-gather-T1": dict(model="mlp", m=3, steps=3, T=1, fisher="gauss-newton", shard="layers",
                                    mode="gather", kl_clip=0.01),
    "gn-cnn-layers-blocks-T2": dict(model="cnn", m=2, steps=4, T=2, fisher="gauss-newton", shard="layers",
                                    mode="gram-blocks"),
    "gn-mlp-root-auto-T1": dict(model="mlp", m=3, steps=3, T=1, fisher="gauss-newton", shard="root",
                                opts=dict(metric="factored")),
    # position_rows / curvature_samples: the k rows of the global batch, each rank's part gathered whole
    "rows5-block-gather-T1": dict(model="block", m=3, steps=3, T=1, mode="gather", opts=dict(position_rows=5)),
    "rows7-block-auto-mc-T2": dict(model="block", m=3, steps=4, T=2, fisher="mc",
                                   opts=dict(position_rows=7, metric="factored")),
    "samples4-block-T2": dict(model="block", m=3, steps=4, T=2, opts=dict(curvature_samples=4)),
    "samples2-cnn-layers-T1": dict(model="cnn", m=3, steps=3, T=1, shard="layers",  # rank 1 holds none
                                   opts=dict(curvature_samples=2, relative_damping=True)),
    # the GGN of the global batch's first k samples (k = 2: rank 1 holds none)
    "gn-samples2-mlp-gather-T1": dict(model="mlp", m=3, steps=4, T=1, fisher="gauss-newton", mode="gather",
                                      opts=dict(curvature_samples=2)),
    "gn-samples4-mlp-layers-blocks-T1": dict(model="mlp", m=3, steps=4, T=1, fisher="gauss-newton", shard="layers",
                                             mode="gram-blocks", opts=dict(curvature_samples=4)),
    "gn-samples2-mlp-layers-blocks-T2": dict(model="mlp", m=3, steps=4, T=2, fisher="gauss-newton", shard="layers",
                                             mode="gram-blocks", opts=dict(curvature_samples=2)),
    # layers recorded as per-sample gradients P only: an added parameter and a bias-only layer
    "extras-auto-T1": dict(model="mlp-extras", m=3, steps=3, T=1),
    "extras-layers-blocks-mc-T2": dict(model="mlp-extras", m=2, steps=4, T=2, fisher="mc", shard="layers",
                                       mode="gram-blocks", opts=dict(metric="factored")),
    # grouped convolutions (on 2 ranks each shard's rows whole groups: the groups' input channels cut with them)
    "grouped-layers-auto-T1": dict(model="cnn-grouped", m=3, steps=3, T=1, shard="layers"),
    "grouped-layers-blocks-mc-T2": dict(model="cnn-grouped", m=2, steps=4, T=2, shard="layers", mode="gram-blocks",
                                        fisher="mc"),
    # the bytes of a curvature step (step 0) less a reuse step's (step 1), with k = 5 of the 24 rows and without
    "bytes-rows5": dict(model="block", m=3, steps=2, T=2, mode="gather", opts=dict(position_rows=5)),
    "bytes-full": dict(model="block", m=3, steps=2, T=2, mode="gather"),
    # S recomputed on reuse steps (Metric.root_every): each rank's whole kept rows rescaled, cut and summed again
    "roots-mlp-gather-T3": dict(model="mlp", m=3, steps=6, T=3, mode="gather",
                                opts=dict(metric=Metric("kronecker", beta2=0.9, root_every=2))),
    "roots-mlp-blocks-T3": dict(model="mlp", m=2, steps=4, T=3, mode="gram-blocks",
                                opts=dict(metric=Metric("factored", beta2=0.9, root_every=1), relative_damping=True)),
    "roots-conv1d-auto-T3": dict(model="conv1d", m=3, steps=6, T=3,
                                 opts=dict(metric=Metric("kronecker", beta2=0.9, root_every=2))),
}
# a metric's state through torch.distributed.checkpoint: saved after 2 steps, resumed for 2 more
for _kind in ("factored", "kronecker"):
    _run_cfg = dict(model="mlp", m=2, T=1, opts=dict(metric=_kind))
    TWO[f"{_kind}-full"] = dict(_run_cfg, steps=4)
    TWO[f"{_kind}-save"] = dict(_run_cfg, steps=2, save=_kind)
RESUME = {f"{kind}-resume": dict(model="mlp", m=2, T=1, steps=2, start=2, load=kind, opts=dict(metric=kind))
          for kind in ("factored", "kronecker")}
FOUR: dict[str, dict[str, Any]] = {  # (the block's key bias has a roundoff gradient: softmax is shift-invariant)
    "relative-hsdp-blocks-T2": dict(model="cnn", m=2, steps=4, T=2, mesh=(2, 2), mode="gram-blocks",
                                    opts=dict(relative_damping=True)),
    "kronecker-mlp-hsdp-auto-T1": dict(model="mlp", m=2, steps=3, T=1, mesh=(2, 2), opts=dict(metric="kronecker")),
    "gn-cnn-hsdp-layers-T1": dict(model="cnn", m=2, steps=3, T=1, mesh=(2, 2), fisher="gauss-newton",
                                  shard="layers"),
    "rows6-block-hsdp-T1": dict(model="block", m=2, steps=3, T=1, mesh=(2, 2), opts=dict(position_rows=6)),
    "rows6-block-hsdp-blocks-T1": dict(model="block", m=2, steps=3, T=1, mesh=(2, 2), mode="gram-blocks",
                                       opts=dict(position_rows=6)),
    "samples3-cnn-hsdp-blocks-T2": dict(model="cnn", m=2, steps=4, T=2, mesh=(2, 2), mode="gram-blocks",  # 2, 1, 0, 0
                                        opts=dict(curvature_samples=3)),
    # c2's groups of 2 output channels split by the shards' one row each (completed by zero rows)
    "grouped-4-layers-blocks-T1": dict(model="cnn-grouped", m=2, steps=3, T=1, shard="layers", mode="gram-blocks"),
    "factored-block-4-blocks-T2": dict(model="block", m=2, steps=4, T=2, mode="gram-blocks",
                                       opts=dict(metric="factored")),
    "factored-block-hsdp-gather-T1": dict(model="block", m=2, steps=3, T=1, mesh=(2, 2), mode="gather",
                                          opts=dict(metric="factored", compile=True), reference=dict(compile=False)),
}




@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tmp_path_factory.mktemp("fsdp2_options_dcp")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, checkpoints: Any) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_options"), 2, TWO, checkpoints)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    return run_table(tmp_path_factory.mktemp("fsdp2_options4"), 4, FOUR)


def _check(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    check_run(cfg, ranks, TOL)


def test_per_sample_layers_are_gathered(two: dict[str, list[dict[str, Any]]]) -> None:
    """Under ``mode="gram-blocks"`` the added parameter and the bias-only layer (per-sample
    gradients ``P``, cut by rows once gathered) are gathered, the other layers cut to the shards."""
    plan = two["extras-layers-blocks-mc-T2"][0]["plan"]
    assert {n: v["mode"] for n, v in plan.items() if v["mode"] == "gather"}.keys() == {"pos", "fc2"}
    assert {v["mode"] for n, v in plan.items() if n not in ("pos", "fc2")} == {"gram-blocks"}


@pytest.mark.parametrize("name", [k for k in TWO if not k.endswith("-save") and not k.startswith("bytes")])
def test_two_ranks_equal_global_batch(two: dict[str, list[dict[str, Any]]], name: str) -> None:
    _check(TWO[name], two[name])


@pytest.mark.parametrize("name", [k for k in FOUR if not FOUR[k].get("expect_error")])
def test_four_ranks_equal_global_batch(four: dict[str, list[dict[str, Any]]], name: str) -> None:
    _check(FOUR[name], four[name])



@pytest.mark.parametrize("kind", ["factored", "kronecker"])
def test_metric_checkpoint_resumes_bit_for_bit(tmp_path: Any, two: dict[str, list[dict[str, Any]]],
                                               checkpoints: Any, kind: str) -> None:
    """The metric's whole moments and ``S`` are in the checkpoint (a fresh optimizer's
    ``state_dict`` lists them for ``torch.distributed.checkpoint`` to load into): 2 steps
    after loading the 2-step checkpoint are the uninterrupted run's steps 3 and 4, bit for bit."""
    name = f"{kind}-resume"
    resumed = run_table(tmp_path, 2, {name: RESUME[name]}, checkpoints)[name][0]["traj"]
    full = two[f"{kind}-full"][0]["traj"]
    for k in range(3):
        assert all(torch.equal(resumed[k][n], full[2 + k][n]) for n in full[0]), f"step {k}"


def test_position_rows_records_bytes_are_k_rows(two: dict[str, list[dict[str, Any]]]) -> None:
    """The records a curvature step sends per layer (summed over the ranks): with
    ``position_rows=5`` a Linear's (the head tied to the embedding included) are ``5/24`` of the
    whole global batch's (``W·m·S = 2·3·4`` rows of ``I``, ``G``); the norm layers keep one row
    per sample (:mod:`tengrad_fx.optim.tengrad.position_rows`), their bytes unchanged."""
    def records(name: str) -> dict[str, int]:
        ranks = two[name]
        return {n: sum(r["comm"][0][n] - r["comm"][1][n] for r in ranks) for n in ranks[0]["comm"][0]}
    rows, full = records("bytes-rows5"), records("bytes-full")
    linear = {"block.q", "block.k", "block.v", "block.o", "block.fc1", "block.fc2", "head"}
    assert linear < rows.keys() == full.keys()
    for n in rows:
        assert 0 < rows[n] and rows[n] * 24 == full[n] * (5 if n in linear else 24), (n, rows[n], full[n])
