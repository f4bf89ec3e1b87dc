"""``DistributedTENGraD`` on FSDP2-sharded models (``fully_shard``, gloo, float64, spawned
ranks) against single-process ``TENGraD`` on the concatenated global batch.

Each world size is one spawn running several configurations in turn (module fixtures).
Checked per configuration: every parameter's change at every step equals the
reference's to ``≤ 1e-10`` (relative), on curvature and reuse steps, empirical and MC (the
reference is given the ranks' sampled labels); the ranks agree on the gathered
parameters; a rank's optimizer state is its shards' (``1/S`` of each parameter); the
resharded checkpoints and the refused orders are checked below.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from testing.distributed import run_ranks
from testing.fsdp_workers import accumulated_reference, train_accumulated, train_fsdp, train_reference

TOL = 1e-10

TWO = {
    "block-empirical-T1": dict(model="block", m=3, steps=5, T=1, mode="gather"),
    "block-mc-T3": dict(model="block", m=3, steps=5, T=3, fisher="mc", mode="gather"),
    "block-mc-T1": dict(model="block", m=3, steps=5, T=1, fisher="mc"),
    "block-empirical-T3": dict(model="block", m=3, steps=5, T=3),
    "block-layers-T3-clip": dict(model="block", m=2, steps=5, T=3, shard="layers", kl_clip=0.01),
    "cnn-empirical-T1": dict(model="cnn", m=3, steps=5, T=1, shard="layers"),
    "cnn-mc-T3": dict(model="cnn", m=3, steps=5, T=3, fisher="mc"),
    "block-blocks-T1": dict(model="block", m=3, steps=5, T=1, mode="gram-blocks"),
    "block-blocks-mc-T3-clip": dict(model="block", m=2, steps=5, T=3, mode="gram-blocks", fisher="mc",
                                    kl_clip=0.01),
    "cnn-blocks-T3": dict(model="cnn", m=3, steps=5, T=3, mode="gram-blocks", shard="layers"),
    "block-prepare-first-root": dict(model="block", m=2, steps=3, T=1, order="prepare-first", shard="root"),
    "block-prepare-first-blocks": dict(model="block", m=2, steps=1, order="prepare-first", expect_error=True),
    "block-mp-float32": dict(model="block", m=3, steps=3, T=1, mp="low", mode="gather"),
    "block-mp-float32-blocks": dict(model="block", m=3, steps=3, T=1, mp="low", mode="gram-blocks"),
    "block-nan": dict(model="block", m=2, steps=3, T=1, nan_rank=1, nan_step=1),
    "block-plain-tengrad": dict(model="block", m=2, steps=1, plain=True, expect_error=True),
    "block-full-T3": dict(model="block", m=2, steps=5, T=3),  # uninterrupted run of the checkpoint tests
    "block-save": dict(model="block", m=2, steps=3, T=3),  # + save (fixture)
    "block-resume-2": dict(model="block", m=2, steps=2, T=3, start=3),  # + load (fixture)
}
RESUMES = ("block-full-T3", "block-save", "block-resume-2", "block-prepare-first-blocks", "block-plain-tengrad",
           "block-mp-float32", "block-mp-float32-blocks", "block-nan")
FOUR = {
    "block-empirical-T3": dict(model="block", m=2, steps=5, T=3, mode="gather"),
    "block-hsdp-mc-T1": dict(model="block", m=2, steps=5, T=1, fisher="mc", mesh=(2, 2)),
    "block-hsdp-blocks-T3": dict(model="block", m=2, steps=5, T=3, mesh=(2, 2), mode="gram-blocks"),
    "cnn-blocks-mc-T1": dict(model="cnn", m=2, steps=5, T=1, fisher="mc", mode="gram-blocks"),
    "cnn-hsdp-T3-mp": dict(model="cnn", m=2, steps=5, T=3, mesh=(2, 2), mp=True, shard="layers"),
    # owner polar factor and graft on 4 shards (7 rows: 2 + 2 + 2 + 1; 5: 2 + 2 + 1 + 0) and on HSDP's 2 × 2
    "mlp-polar-graft": dict(model="mlp", m=2, steps=3, T=1, opts=dict(orthogonalize=True, graft="sgd")),
    "mlp-hsdp-polar-momentum": dict(model="mlp", m=2, steps=3, T=1, mesh=(2, 2), mode="gram-blocks",
                                    opts=dict(orthogonalize="newton-schulz", orthogonalize_momentum=True,
                                              graft="rmsprop")),
    "block-resume-4": dict(model="block", m=1, steps=2, T=3, start=3),  # + load (fixture)
}
ONE = {"block-resume-1": dict(model="block", m=4, steps=2, T=3, start=3)}  # + load (fixture)


def _run(tmp: Any, world: int, table: dict[str, dict[str, Any]], ckpt: Any = None) -> dict[str, Any]:
    cfgs = {k: dict(v) for k, v in table.items()}
    for k, cfg in cfgs.items():
        if k == "block-save":
            cfg["save"] = str(ckpt)
        elif k.startswith("block-resume"):
            cfg["load"] = str(ckpt)
    res = run_ranks(train_fsdp, world, tmp, list(cfgs.values()), timeout=600)
    return {"cfgs": cfgs, "ranks": {k: [r[i] for r in res] for i, k in enumerate(cfgs)}, "ckpt": ckpt}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("fsdp2")
    return _run(d, 2, TWO, d / "dcp")


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory, two: dict[str, Any]) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("fsdp4"), 4, FOUR, two["ckpt"])


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory, two: dict[str, Any]) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("fsdp1"), 1, ONE, two["ckpt"])


def _check_equal_to_global(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    ref = train_reference(cfg, len(ranks))  # MC: its own labels, from the generator seeded as the ranks' one
    got = ranks[0]["traj"]
    assert got[0].keys() == ref[0].keys()
    for k in range(1, cfg["steps"] + 1):
        for name in ref[k]:
            d, dr = got[k][name] - got[k - 1][name], ref[k][name] - ref[k - 1][name]
            assert dr.norm() > 0
            err = ((d - dr).norm() / dr.norm()).item()
            assert err <= TOL, f"step {k - 1}, {name}: relative error {err:.2e} vs the global-batch update"
        for r, other in enumerate(ranks[1:], 1):
            assert all(torch.equal(other["traj"][k][n], got[k][n]) for n in got[k]), f"rank {r} differs"


@pytest.mark.parametrize("name", [k for k in TWO if k not in RESUMES])
def test_two_ranks_equal_global_batch(two: dict[str, Any], name: str) -> None:
    ranks = two["ranks"][name]
    assert ranks[0]["type"] == "FSDPTENGraD"
    assert ranks[0]["counters"] == {"step": two["cfgs"][name]["steps"], "skipped": 0, "uncaptured": 0}
    _check_equal_to_global(two["cfgs"][name], ranks)


@pytest.mark.parametrize("name", [k for k in FOUR if k != "block-resume-4"])
def test_four_ranks_equal_global_batch(four: dict[str, Any], name: str) -> None:
    _check_equal_to_global(four["cfgs"][name], four["ranks"][name])


def test_optimizer_state_is_sharded(two: dict[str, Any]) -> None:
    """Per rank the per-parameter optimizer state takes at most 0.6× the bytes of
    single-process TENGraD's over the same model (2 ranks)."""
    name = "block-empirical-T1"
    stats: dict[str, Any] = {}
    train_reference(two["cfgs"][name], 2, stats=stats)
    single = stats["state_bytes"]
    ranks = two["ranks"][name]
    assert single > 0 and single == sum(b.numel() * b.element_size() for b in ranks[0]["bufs"].values())
    for r in ranks:
        assert 0 < r["state_bytes"] <= 0.6 * single
    assert sum(r["state_bytes"] for r in ranks) == single


def test_fx_prepared_then_sharded_submodules_is_refused(two: dict[str, Any]) -> None:
    """``prepare`` by torch.fx, then ``fully_shard`` on submodules: a clear error naming the order."""
    for r in two["ranks"]["block-prepare-first-blocks"]:
        assert "fully_shard on the submodules and the root first" in r["error"]


def test_single_process_tengrad_refuses_sharded_parameters(two: dict[str, Any]) -> None:
    for r in two["ranks"]["block-plain-tengrad"]:
        assert "use tengrad_fx.distributed.DistributedTENGraD" in r["error"]


def test_checkpoint_resumes_bit_for_bit_on_the_same_world(two: dict[str, Any]) -> None:
    """DCP save after 3 steps on 2 ranks, load on 2 ranks: the same bits as the uninterrupted run."""
    full, resumed = two["ranks"]["block-full-T3"][0]["traj"], two["ranks"]["block-resume-2"][0]["traj"]
    for k in range(3):
        assert all(torch.equal(resumed[k][n], full[3 + k][n]) for n in full[0]), f"step {k}"


@pytest.mark.parametrize("world", [1, 4])
def test_checkpoint_reshards(request: pytest.FixtureRequest, two: dict[str, Any], world: int) -> None:
    """The 2-rank checkpoint loads on 1 and on 4 ranks (the same global batch): the loaded
    parameters are the saved bits and the run goes on as the uninterrupted one (≤ 1e-10)."""
    run = request.getfixturevalue("one" if world == 1 else "four")
    resumed = run["ranks"][f"block-resume-{world}"][0]["traj"]
    full = two["ranks"]["block-full-T3"][0]["traj"]
    assert all(torch.equal(resumed[0][n], full[3][n]) for n in full[0])
    for k in range(1, 3):
        for n in full[0]:
            d, dr = resumed[k][n] - resumed[k - 1][n], full[3 + k][n] - full[2 + k][n]
            assert ((d - dr).norm() / dr.norm()).item() <= TOL, f"step {k}, {n}"


def test_modes_per_layer(two: dict[str, Any]) -> None:
    """``mode="gram-blocks"`` / ``"gather"`` take it for every layer; ``"auto"`` picks per
    layer (on the CNN both: the first convolution's and the norms' cut saves more than the
    Grams' all-reduce costs, the second convolution's and the head's does not)."""
    forced = two["ranks"]["block-blocks-T1"][0]["plan"]
    assert forced and {v["mode"] for v in forced.values()} == {"gram-blocks"}
    assert {v["mode"] for v in two["ranks"]["block-empirical-T1"][0]["plan"].values()} == {"gather"}
    mixed = two["ranks"]["cnn-mc-T3"]
    assert {v["mode"] for v in mixed[0]["plan"].values()} == {"gather", "gram-blocks"}
    assert all(r["plan"] == mixed[0]["plan"] for r in mixed)
    assert all(v["placement"] == "replicate" for v in forced.values())


@pytest.mark.parametrize("name", ["block-mp-float32", "block-mp-float32-blocks"])
def test_mixed_precision_float32_compute(two: dict[str, Any], name: str) -> None:
    """``MixedPrecisionPolicy(param_dtype=float32)`` on float64 parameters: the forward,
    backward and records in float32, the update on float64 shards; it steps without skips
    and stays within float32's reach of the float64 global-batch run."""
    cfg, ranks = two["cfgs"][name], two["ranks"][name]
    assert ranks[0]["counters"] == {"step": 3, "skipped": 0, "uncaptured": 0}
    ref = train_reference(cfg, 2)
    got = ranks[0]["traj"]
    for k in range(1, 4):
        for n in ref[k]:
            d, dr = got[k][n] - got[k - 1][n], ref[k][n] - ref[k - 1][n]
            assert got[k][n].dtype == torch.float64
            assert ((d - dr).norm() / dr.norm()).item() < 1e-2, f"step {k - 1}, {n}"


def test_nonfinite_gradient_shard_on_one_rank_skips_on_all(two: dict[str, Any]) -> None:
    ranks = two["ranks"]["block-nan"]
    for r in ranks:
        assert r["counters"]["skipped"] == 1 and r["counters"]["step"] == 2
        assert all(torch.equal(r["traj"][2][n], r["traj"][1][n]) for n in r["traj"][1])  # step 1: unchanged
        assert all(torch.isfinite(t).all() for t in r["traj"][3].values())
        assert not all(torch.equal(r["traj"][3][n], r["traj"][2][n]) for n in r["traj"][2])  # step 2 moved


def test_gradient_accumulation(tmp_path: Any) -> None:
    """Two micro-batches per step on each of 2 ranks (each loss halved): the curvature is
    the union of all ranks' micro-batches, as single-process accumulation over the same
    samples (≤ 1e-10), in both modes."""
    cfgs = [dict(model="block", m=4, steps=3, T=1, accum=2, mode=md) for md in ("gather", "gram-blocks")]
    res = run_ranks(train_accumulated, 2, tmp_path, cfgs, timeout=300)
    for i, cfg in enumerate(cfgs):
        got, ref = res[0][i], accumulated_reference(cfg, 2)
        for k in range(1, cfg["steps"] + 1):
            for n in ref[k]:
                d, dr = got[k][n] - got[k - 1][n], ref[k][n] - ref[k - 1][n]
                assert ((d - dr).norm() / dr.norm()).item() <= TOL, f"{cfg['mode']}, step {k - 1}, {n}"
