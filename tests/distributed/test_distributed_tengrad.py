"""``DistributedTENGraD`` on 2 and 3 gloo ranks (spawned processes, float64) against
single-process ``TENGraD`` on the concatenated global batch.

Each world size is one spawn running several configurations in turn (module fixtures),
so the default suite pays for two process groups. Checked per configuration: every
step's parameter change equals the reference's to ``≤ 1e-10`` (relative), on curvature
and reuse steps, empirical and MC (the reference is given the ranks' sampled labels);
the ranks' parameters are bit-identical after every step, and momentum buffers at the
end (10 steps); a NaN gradient on one rank skips the step on all; a checkpoint of a
2-rank run resumes on 3 ranks (same global batch) exactly as the uninterrupted run.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from testing.dist_workers import global_batch, make_model, train_ranks, train_single
from testing.distributed import run_ranks
from testing.tengrad_step import mc_labels

TOL = 1e-10

TWO = {
    "mlp-empirical-T2": dict(model="mlp", m=4, steps=4, T=2),
    "cnn-mc-T2-clip": dict(model="cnn", m=3, steps=4, T=2, fisher="mc", kl_clip=0.01),
    "mlp-replicate-10": dict(model="mlp", m=3, steps=10, T=3, placement="replicate", kl_clip=0.01),
    "mlp-auto": dict(model="mlp", m=4, steps=4, T=2, placement="auto", fisher="mc"),
    "cnn-prepare-inside-ddp": dict(model="cnn", m=3, steps=3, T=2, inside=True),
    "mlp-gather-10": dict(model="mlp", m=3, steps=10, T=3, fisher="mc"),
    "mlp-nan": dict(model="mlp", m=4, steps=3, T=1, nan_rank=1, nan_step=1),
    "mlp-blocks-T2": dict(model="mlp", m=4, steps=4, T=2, mode="gram-blocks"),
    "cnn-blocks-mc-T2-clip": dict(model="cnn", m=3, steps=4, T=2, mode="gram-blocks", fisher="mc", kl_clip=0.01),
    "cnn-auto-mixed": dict(model="cnn", m=3, steps=4, T=2, mode="auto", bandwidth=1e9, flop_rate=1e10),
    "mlp-blocks-10": dict(model="mlp", m=3, steps=10, T=3, mode="gram-blocks", fisher="mc"),
    "mlp3-blocks-equal-shapes": dict(model="mlp3", m=3, steps=4, T=2, mode="gram-blocks"),
    "cnn-auto-mixed-relative-kronecker": dict(model="cnn", m=3, steps=4, T=2, mode="auto", bandwidth=1e9,
                                              flop_rate=1e10, relative=True, metric="kronecker", placement="auto"),
    "cnn-auto-mixed-sequential": dict(model="cnn", m=3, steps=4, T=2, mode="auto", bandwidth=1e9, flop_rate=1e10,
                                      sequential=True),
    "mlp-groups-gather": dict(model="mlp", m=3, steps=4, T=2, groups=True, kl_clip=0.01),  # lr/α/μ per group
    "mlp-groups-blocks": dict(model="mlp", m=3, steps=4, T=2, groups=True, mode="gram-blocks"),
    "mlp-add-group": dict(model="mlp", m=3, steps=4, T=3, groups=True, add_at=1, mode="auto"),  # add_param_group
    "mlp-graft-orth-gather": dict(model="mlp", m=3, steps=4, T=2, graft="rmsprop", orthogonalize=True,
                                  kl_clip=0.01),  # on every layer's shared u
    "cnn-graft-blocks": dict(model="cnn", m=3, steps=3, T=2, mode="gram-blocks", graft="rmsprop"),
    "mlp-save": dict(model="mlp", m=6, steps=2, T=1),  # + save (fixture)
    "mlp-resume-same": dict(model="mlp", m=6, steps=2, T=1, start=2),  # + load (fixture)
}
THREE = {
    "cnn-empirical-T2": dict(model="cnn", m=2, steps=4, T=2),
    "mlp-mc-T1": dict(model="mlp", m=3, steps=3, T=1, fisher="mc"),
    "cnn-replicate-mc": dict(model="cnn", m=2, steps=3, T=2, fisher="mc", placement="replicate"),
    "mlp-local": dict(model="mlp", m=4, steps=3, T=1, mode="local"),
    "mlp2-a-rank-owns-nothing": dict(model="mlp2", m=3, steps=4, T=2),
    "cnn-blocks-T2": dict(model="cnn", m=2, steps=4, T=2, mode="gram-blocks"),
    "mlp-blocks-mc-T1": dict(model="mlp", m=3, steps=3, T=1, mode="gram-blocks", fisher="mc"),
    "cnn-blocks-replicate-mc": dict(model="cnn", m=2, steps=3, T=2, mode="gram-blocks", fisher="mc",
                                    placement="replicate"),
    "cnn-auto-mixed": dict(model="cnn", m=2, steps=4, T=2, mode="auto", bandwidth=1e9, flop_rate=1e10),
    "mlp2-blocks-a-rank-owns-nothing": dict(model="mlp2", m=3, steps=4, T=2, mode="gram-blocks"),
    # the owners' damping scales reach the rank without factors on curvature steps only (as every rank's)
    "mlp2-blocks-relative-a-rank-owns-nothing": dict(model="mlp2", m=3, steps=4, T=2, mode="gram-blocks",
                                                     relative=True),
    "mlp-resume": dict(model="mlp", m=4, steps=2, T=1, start=2),  # + load (fixture)
    "mlp-unequal-batches": dict(model="mlp", m=4, steps=1, T=1, short_rank=2, expect_error=True),
}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("two")
    cfgs = {k: dict(v) for k, v in TWO.items()}
    cfgs["mlp-save"]["save"] = str(d / "ck.pt")
    cfgs["mlp-resume-same"]["load"] = str(d / "ck.pt")
    res = run_ranks(train_ranks, 2, d, list(cfgs.values()))
    return {"cfgs": cfgs, "ranks": {k: [r[i] for r in res] for i, k in enumerate(cfgs)}, "ckpt": d / "ck.pt"}


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory, two: dict[str, Any]) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("three")
    cfgs = {k: dict(v) for k, v in THREE.items()}
    cfgs["mlp-resume"]["load"] = str(two["ckpt"])
    res = run_ranks(train_ranks, 3, d, list(cfgs.values()))
    return {"cfgs": cfgs, "ranks": {k: [r[i] for r in res] for i, k in enumerate(cfgs)}}


def _check_equal_to_global(cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    ref = train_single(cfg, len(ranks))  # MC: its own labels, from the generator seeded as the ranks' one
    got = ranks[0]["traj"]
    assert torch.equal(got[0], ref[0])
    for k in range(1, cfg["steps"] + 1):
        d, dr = got[k] - got[k - 1], ref[k] - ref[k - 1]
        err = ((d - dr).norm() / dr.norm()).item()
        assert err <= TOL, f"step {k - 1}: relative error {err:.2e} of the update vs the global-batch one"
        for r, other in enumerate(ranks[1:], 1):
            assert torch.equal(other["traj"][k], got[k]), f"rank {r} differs from rank 0 after step {k - 1}"


@pytest.mark.parametrize("name", [k for k in TWO if k not in ("mlp-nan", "mlp-resume-same")])
def test_two_ranks_equal_global_batch(two: dict[str, Any], name: str) -> None:
    _check_equal_to_global(two["cfgs"][name], two["ranks"][name])


@pytest.mark.parametrize("name", [k for k in THREE if k not in ("mlp-resume", "mlp-local", "mlp-unequal-batches")])
def test_three_ranks_equal_global_batch(three: dict[str, Any], name: str) -> None:
    _check_equal_to_global(three["cfgs"][name], three["ranks"][name])


def test_mc_labels_are_the_global_batch_draw(two: dict[str, Any]) -> None:
    """The ranks' first MC labels, concatenated in rank order, are the labels one process
    draws for the global batch after ``seed_mc(seed)`` (:func:`testing.tengrad_step.mc_labels`,
    an independent inverse-CDF draw); the ranks' slices differ."""
    cfg = two["cfgs"]["cnn-mc-T2-clip"]
    drawn = [r["targets"][0] for r in two["ranks"]["cnn-mc-T2-clip"]]
    x, _ = global_batch(cfg["model"], 2 * cfg["m"], cfg.get("start", 0))
    with torch.no_grad():
        want = mc_labels(make_model(cfg["model"])(x), cfg.get("seed", 0))
    assert torch.equal(torch.cat(drawn), want)
    assert not torch.equal(drawn[0], drawn[1])


def test_local_fisher_is_not_what_is_computed(two: dict[str, Any]) -> None:
    """The check above can fail: rank 0's step is not the single-process step on rank 0's
    own shard (the local Fisher) — the curvature really is the global batch's."""
    cfg = dict(TWO["mlp-empirical-T2"])
    got = two["ranks"]["mlp-empirical-T2"][0]["traj"]
    local = train_single({**cfg, "m": cfg["m"]}, 1)  # first m samples of a batch of size m: another batch
    assert ((got[1] - got[0]) - (local[1] - local[0])).norm() > 1e-3 * (got[1] - got[0]).norm()


@pytest.mark.parametrize("name", ["mlp-replicate-10", "mlp-gather-10", "mlp-blocks-10"])
def test_replicas_bit_identical_after_ten_steps(two: dict[str, Any], name: str) -> None:
    a, b = two["ranks"][name]
    assert len(a["traj"]) == 11 and torch.equal(a["traj"][-1], b["traj"][-1])
    assert len(a["bufs"]) == len(b["bufs"]) > 0
    assert all(torch.equal(x, y) for x, y in zip(a["bufs"], b["bufs"]))
    assert a["counters"] == b["counters"] == {"step": 10, "skipped": 0, "uncaptured": 0}


def test_nonfinite_on_one_rank_skips_on_all(two: dict[str, Any]) -> None:
    ranks = two["ranks"]["mlp-nan"]
    for r in ranks:
        assert r["counters"]["skipped"] == 1 and r["counters"]["step"] == 2
        assert torch.equal(r["traj"][2], r["traj"][1])  # step 1 left the parameters unchanged
        assert not torch.equal(r["traj"][3], r["traj"][2])  # step 2 (recaptured) moved them
        assert torch.isfinite(r["traj"][3]).all()
    assert torch.equal(ranks[0]["traj"][3], ranks[1]["traj"][3])


@pytest.mark.parametrize("world", [2, 3])
def test_resume_on_the_same_or_another_world_size(two: dict[str, Any], three: dict[str, Any], world: int) -> None:
    """2 ranks × 6 for 2 steps, checkpoint, then 2 ranks × 6 or 3 ranks × 4 for 2 more
    (same global batches): the same trajectory as 4 uninterrupted single-process steps
    on the 12-sample batches."""
    ref = train_single(dict(model="mlp", m=12, steps=4, T=1), 1)
    ranks = two["ranks"]["mlp-resume-same"] if world == 2 else three["ranks"]["mlp-resume"]
    got = ranks[0]["traj"]
    assert torch.allclose(got[0], ref[2], rtol=0, atol=1e-12)
    for k in (1, 2):
        d, dr = got[k] - got[k - 1], ref[k + 2] - ref[k + 1]
        assert ((d - dr).norm() / dr.norm()).item() <= TOL
    assert all(torch.equal(r["traj"][-1], got[-1]) for r in ranks)
    assert ranks[0]["counters"]["step"] == 4


def _raise_then_step(rank: int, world: int, tmp: str) -> None:
    train_ranks(rank, world, [dict(model="mlp", m=3, steps=3, T=1, raise_rank=1, raise_step=1)])


def test_rank_that_raises_is_a_clear_error_not_a_hang(tmp_path: Path) -> None:
    from testing.distributed import RanksFailed
    with pytest.raises(RanksFailed) as exc:
        run_ranks(_raise_then_step, 2, tmp_path, str(tmp_path), timeout=90, pg_timeout=30)
    errors = exc.value.errors
    assert "injected failure on rank 1" in errors[1]
    assert "DistributedStepError" in errors[0] and "Another rank has most likely raised" in errors[0], errors[0]


def test_local_fisher_mode(three: dict[str, Any]) -> None:
    """``mode="local"``: the first step's ``u`` is the mean over ranks of ``(F_r + αI)⁻¹ g``
    (per-rank Fisher, global gradient), not the global-batch update; replicas identical."""
    from testing.dist_workers import local_fisher_reference
    cfg = THREE["mlp-local"]
    ranks = three["ranks"]["mlp-local"]
    got = ranks[0]["traj"]
    lr, wd = 0.1, 1e-3
    u = (got[0] - got[1]) / lr - wd * got[0]
    ref = local_fisher_reference(cfg, 3)
    assert ((u - ref).norm() / ref.norm()).item() <= TOL
    glob = train_single(cfg, 3)
    u_glob = (glob[0] - glob[1]) / lr - wd * glob[0]
    assert ((u - u_glob).norm() / u_glob.norm()).item() > 1e-3
    for k in range(1, cfg["steps"] + 1):
        assert all(torch.equal(r["traj"][k], got[k]) for r in ranks[1:])


def test_unequal_local_batches_are_a_clear_error_on_every_rank(three: dict[str, Any]) -> None:
    """Rank 2 captured 3 samples, the others 4: every rank raises the same ValueError
    (naming the layer and the ranks) at the curvature step; none hangs."""
    errors = [r["error"] for r in three["ranks"]["mlp-unequal-batches"]]
    assert len(errors) == 3 and len(set(errors)) == 1
    assert "on rank 2" in errors[0] and "same local batch size" in errors[0]


def test_a_rank_may_own_no_layer(three: dict[str, Any]) -> None:
    owners = three["ranks"]["mlp2-a-rank-owns-nothing"][0]["owner"]
    assert sorted(owners.values()) in ([0, 1], [0, 2], [1, 2])  # two layers, three ranks


@pytest.mark.parametrize("world", [2, 3])
def test_auto_mode_mixes_gather_and_gram_blocks(two: dict[str, Any], three: dict[str, Any], world: int) -> None:
    """``mode="auto"``: the layers take the modes of :func:`plan.choose_modes` for their
    shapes and owners (here a slow link: the first convolution, whose ``J g`` on the
    global batch makes its owner the straggler, goes ``gram-blocks``, the Linear head
    stays ``gather``), reported by ``layer_plan()`` identically on every rank; the update
    is still the global one (``test_*_ranks_equal_global_batch[cnn-auto-mixed]``)."""
    import torch.nn.functional as F
    import tengrad_fx
    from tengrad_fx.distributed.plan import choose_modes
    from tengrad_fx.distributed.records import record_bytes
    from testing.dist_workers import global_batch, make_model
    cfg = (TWO if world == 2 else THREE)["cnn-auto-mixed"]
    ranks = (two if world == 2 else three)["ranks"]["cnn-auto-mixed"]
    plan = ranks[0]["plan"]
    assert all(r["plan"] == plan for r in ranks)
    net = tengrad_fx.prepare(make_model("cnn"))
    x, y = global_batch("cnn", cfg["m"], 0)
    F.cross_entropy(net(x), y).backward()
    lays = tengrad_fx.covered_layers(net)
    ns = [sum(p.numel() for p in (lay.weight, lay.bias) if p is not None) for lay in lays]
    M = world * cfg["m"]
    recs = [record_bytes(lay, M, "auto") for lay in lays]
    want = choose_modes(M, ns, [lay.dims() for lay in lays], [plan[lay.name]["owner"] for lay in lays],
                        world, cfg["bandwidth"], cfg["flop_rate"], recs, cfg["T"])
    assert [plan[lay.name]["mode"] for lay in lays] == want
    assert want[0] == "gram-blocks" and want[-1] == "gather"


def test_relative_damping_and_metric_with_mixed_modes(two: dict[str, Any]) -> None:
    """``relative_damping`` and ``metric`` with gather and gram-blocks layers in one step
    (each rank's gather layers and every gram-blocks layer take their own ``α_l``), owned
    and replicated layers (placement ``"auto"``); its
    update equals the global one (``test_two_ranks_equal_global_batch``)."""
    plan = two["ranks"]["cnn-auto-mixed-relative-kronecker"][0]["plan"]
    assert {v["mode"] for v in plan.values()} == {"gather", "gram-blocks"}
    assert {v["placement"] for v in plan.values()} == {"owner", "replicate"}


def test_overlap_changes_no_bit(two: dict[str, Any]) -> None:
    """Overlapping the collectives with the work (the default) gives the same bits as
    running them one after the other, on every rank and step (gather and gram-blocks mixed)."""
    a, b = two["ranks"]["cnn-auto-mixed"], two["ranks"]["cnn-auto-mixed-sequential"]
    assert {v["mode"] for v in a[0]["plan"].values()} == {"gather", "gram-blocks"}
    for ra, rb in zip(a, b):
        assert all(torch.equal(x, y) for x, y in zip(ra["traj"], rb["traj"]))


def test_gram_blocks_reuse_step_moves_only_vectors(two: dict[str, Any]) -> None:
    """A reuse step of a ``gram-blocks`` layer sends, per rank, its ``m`` values of ``J g``
    (ring all-gather), the owner's ``c`` (``M`` values, once) and the ``Jᵀc`` partial sums
    (ring all-reduce of ``n`` values) — never records or per-sample gradients."""
    from testing.dist_workers import make_model
    cfg = TWO["mlp-blocks-T2"]  # steps 0, 2 take curvature; 1, 3 reuse it
    W, m = 2, cfg["m"]
    lins = [mod for mod in make_model("mlp").modules() if isinstance(mod, torch.nn.Linear)]
    for r in two["ranks"]["mlp-blocks-T2"]:
        assert set(r["plan"]) == {"0", "2", "4"} and all(v["mode"] == "gram-blocks" for v in r["plan"].values())
        for name, lin in zip(("0", "2", "4"), lins):
            n = lin.weight.numel() + lin.bias.numel()
            want = ((W - 1) * m + W * m + int(2 * (W - 1) / W * n)) * 8  # float64
            assert r["bytes"][name] == want, (name, r["bytes"][name], want)


def test_gather_sends_per_sample_gradients_where_smaller(three: dict[str, Any]) -> None:
    """A gather layer whose ``P`` (``n`` per sample) is smaller than its ``I``, ``G`` and
    that the owner materializes anyway travels as ``P`` and its bias sums: the first conv's
    bytes on a curvature step (the last step of this config, replicated: a ring all-gather
    of ``W − 1`` parts) are ``P``'s, not ``I``, ``G``'s; the update is still the global one
    (``test_three_ranks_equal_global_batch[cnn-replicate-mc]``)."""
    from testing.dist_workers import make_model
    W, m = 3, THREE["cnn-replicate-mc"]["m"]
    conv = make_model("cnn")[0]  # Conv2d(3, 4, 3, padding=1) on 6x6
    n_w, o = conv.weight.numel(), conv.out_channels
    r_ig = 3 * 6 * 6 + 4 * 6 * 6  # I and G per sample
    assert n_w + o < r_ig
    for r in three["ranks"]["cnn-replicate-mc"]:
        assert r["plan"]["0"]["mode"] == "gather"
        assert r["bytes"]["0"] == (W - 1) * m * (n_w + o) * 8
