"""``graft``, ``orthogonalize`` and ``orthogonalize_momentum`` under FSDP2, 2 gloo ranks,
float64, on an MLP of odd widths (uneven row shards): every parameter's change at every
step equals single-process ``TENGraD``'s on the concatenated batch to ``≤ 1e-10``
(relative), and each rank computes the polar factor of exactly the weights it owns
(:func:`tengrad_fx.distributed.plan.polar_owners`), whose work is at most ``total/W`` plus
one matrix. One spawn runs every configuration.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tengrad_fx.distributed.fsdp_rows import row_chunk
from tengrad_fx.distributed.plan import polar_owners, polar_work
from testing.distributed import run_ranks
from testing.fsdp_polar import PROBE_SHAPES
from testing.fsdp_workers import assert_follows_reference, train_fsdp, train_reference

TOL = 1e-10
WORLD = 2
MATS = {"fc1": (7, 6), "fc2": (9, 7), "fc3": (9, 9), "fc4": (5, 9)}  # testing.fsdp_polar.MLP's weights
CFGS = {
    "eigh-T1": dict(model="mlp", m=3, steps=3, T=1, mode="gather", opts=dict(orthogonalize=True)),
    "ns-momentum-T2-clip": dict(model="mlp", m=3, steps=3, T=2, mode="gather", kl_clip=0.01,
                                opts=dict(orthogonalize="newton-schulz", orthogonalize_momentum=True)),
    "graft-sgd-blocks": dict(model="mlp", m=3, steps=3, T=1, mode="gram-blocks", opts=dict(graft="sgd")),
    "graft-rmsprop-eigh-optout": dict(model="mlp", m=3, steps=3, T=1, mode="gather", no_polar=["fc4"],
                                      opts=dict(graft="rmsprop", orthogonalize=True)),
    "graft-rmsprop-ns-momentum": dict(model="mlp", m=3, steps=3, T=1, mode="gram-blocks", kl_clip=0.01,
                                      opts=dict(graft="rmsprop", orthogonalize="newton-schulz",
                                                orthogonalize_momentum=True)),
}
PROBE = dict(model="polar-probe")
SHAPED = dict(model="mlp", m=3, T=1, mode="gather",
              opts=dict(graft="rmsprop", orthogonalize="newton-schulz", orthogonalize_momentum=True))
RESUME = {"full": dict(SHAPED, steps=4), "save": dict(SHAPED, steps=2),  # + save (fixture)
          "resume": dict(SHAPED, steps=2, start=2)}  # + load (fixture)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    ckpt = str(tmp_path_factory.mktemp("fsdp2_polar_ckpt") / "ckpt")
    resume = [RESUME["full"], dict(RESUME["save"], save=ckpt), dict(RESUME["resume"], load=ckpt)]
    res = run_ranks(train_fsdp, WORLD, tmp_path_factory.mktemp("fsdp2_polar"), [*CFGS.values(), PROBE, *resume],
                    timeout=600)
    return {name: [r[i] for r in res] for i, name in enumerate([*CFGS, "probe", *RESUME])}


@pytest.mark.parametrize("name", list(CFGS))
def test_shaping_under_fsdp2_equals_global_batch(ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    cfg, got = CFGS[name], ranks[name]
    assert got[0]["type"] == "FSDPTENGraD"
    assert got[0]["counters"] == {"step": cfg["steps"], "skipped": 0, "uncaptured": 0}
    ref = train_reference(cfg, WORLD)
    traj = got[0]["traj"]
    assert traj[0].keys() == ref[0].keys()
    assert_follows_reference(got, ref, cfg["steps"], TOL)


@pytest.mark.parametrize("name", [n for n, c in CFGS.items() if c["opts"].get("orthogonalize")])
def test_each_rank_orthogonalizes_only_its_own_weights(ranks: dict[str, list[dict[str, Any]]], name: str) -> None:
    cfg, got = CFGS[name], ranks[name]
    polar = [n for n in MATS if n not in cfg.get("no_polar", [])]
    expect = dict(zip(polar, polar_owners([MATS[n] for n in polar], WORLD)))
    assert set(expect.values()) == set(range(WORLD))  # both ranks own a weight
    total = sum(polar_work(*MATS[n]) for n in polar)
    for r in range(WORLD):
        assert all(owners == expect for owners in got[r]["polar_owners"]), got[r]["polar_owners"]
        mine = sorted(MATS[n] for n in polar if expect[n] == r)
        calls = sorted(got[r]["polar_calls"])  # one polar factor per owned weight per step, and no other
        assert calls == sorted(s for s in mine for _ in range(cfg["steps"])), (r, calls)
        work = sum(polar_work(*MATS[n]) for n in polar if expect[n] == r)
        assert work <= total / WORLD + max(polar_work(*MATS[n]) for n in polar)


def test_polar_owners_balance_by_size() -> None:
    """Greedy by decreasing size onto the least loaded rank: every rank's work within one
    matrix of ``total/W``; deterministic; the largest matrix first on rank 0."""
    shapes = [(7, 6), (9, 7), (9, 9), (5, 9), (64, 3), (3, 64), (16, 16), (1, 40)]
    for world in (1, 2, 3, 5):
        owners = polar_owners(shapes, world)
        assert owners == polar_owners(shapes, world) and set(owners) <= set(range(world))
        work = [polar_work(*shapes[i]) for i in range(len(shapes))]
        load = [sum(w for w, o in zip(work, owners) if o == r) for r in range(world)]
        assert max(load) <= sum(work) / world + max(work)
        assert owners[max(range(len(work)), key=lambda i: (work[i], -i))] == 0
    assert polar_owners([(9, 9), (9, 9), (3, 3)], 2) == [0, 1, 0]
    assert polar_work(64, 3) == polar_work(3, 64) == 9 * 64


def test_owner_polar_is_bit_exact(ranks: dict[str, list[dict[str, Any]]]) -> None:
    """The exchange alone (:func:`tengrad_fx.distributed.fsdp_shaping.owner_polar`) on
    updates sharded by rows: every rank's rows of every polar factor equal the
    single-process function's on the whole update bit for bit (uneven and empty shards,
    two weights of one shape, float32 beside float64), each weight orthogonalized once,
    by its owner; the bytes each rank sends per weight."""
    got = ranks["probe"]
    shapes = [(s[0], math.prod(s[1:])) for s, _ in PROBE_SHAPES]
    owners = polar_owners(shapes, WORLD)
    for method in ("eigh", "newton-schulz"):
        for r in range(WORLD):
            res = got[r][method]
            assert res["owners"] == owners
            assert all(res["equal"]), (method, r, res["equal"])
            assert sorted(res["calls"]) == sorted(s for s, o in zip(shapes, owners) if o == r)
            # sent: its rows of the others' weights; of its own, the other ranks' rows of the result
            es = [torch.finfo(dt).bits // 8 for _, dt in PROBE_SHAPES]
            held = [row_chunk(a, WORLD, r)[1] - row_chunk(a, WORLD, r)[0] for a, _ in shapes]
            assert res["sent"] == [(a - h if o == r else h) * b * e
                                   for (a, b), h, o, e in zip(shapes, held, owners, es)]


def test_checkpoint_keeps_the_shaping_state(ranks: dict[str, list[dict[str, Any]]]) -> None:
    """RMSProp's moments and Muon's momentum (DTensors of the weights' placements) go through
    a DCP checkpoint: saved after 2 steps and loaded, the run continues bit for bit as the
    uninterrupted one (``T = 1``: the curvature, not saved, is taken anew either way)."""
    full, resumed = ranks["full"][0]["traj"], ranks["resume"][0]["traj"]
    assert all(torch.equal(resumed[0][n], full[2][n]) for n in full[0])
    for k in (1, 2):
        assert all(torch.equal(resumed[k][n], full[2 + k][n]) for n in full[0]), f"step {k}"
