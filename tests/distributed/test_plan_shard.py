"""The owner assignment, the per-rank shards and the argument checks (no process group)."""
from __future__ import annotations

import pytest
import torch

import tengrad_fx
from tengrad_fx.distributed import DistributedTENGraD, assign_owners, shard_indices, solve_cost


def test_assign_owners_is_greedy_by_cost() -> None:
    costs = [1.0, 10.0, 3.0, 3.0, 2.0]
    owner = assign_owners(costs, 2)
    # 10 -> r0; 3 -> r1; 3 -> r1 (load 3 < 10); 2 -> r1 (6 < 10); 1 -> r1 (8 < 10)
    assert owner == [1, 0, 1, 1, 1]
    loads = [sum(c for c, o in zip(costs, owner) if o == r) for r in range(2)]
    assert max(loads) == 10.0
    assert assign_owners(costs, 1) == [0] * 5
    assert sorted(set(assign_owners([1.0] * 6, 3))) == [0, 1, 2]


def test_solve_cost_counts_gram_and_cholesky() -> None:
    M, dims = 64, (1, 1, 100, 10)  # Linear 100 -> 10
    gram = min(2.0 * M * M * (100 + 10), 2.0 * M * 100 * 10 + 2.0 * M * M * 100 * 10)
    assert solve_cost(M, dims) == pytest.approx(gram + M ** 3 / 3)


@pytest.mark.parametrize("n,world", [(10, 3), (12, 4), (7, 1)])
def test_shards_are_disjoint_and_equal(n: int, world: int) -> None:
    parts = [shard_indices(n, r, world, epoch=1, seed=5) for r in range(world)]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == n // world
    allidx = torch.cat(parts)
    assert len(set(allidx.tolist())) == len(allidx) and int(allidx.max()) < n
    assert not torch.equal(shard_indices(n, 0, world, epoch=1, seed=5), shard_indices(n, 0, world, epoch=2, seed=5)) \
        or n // world < 3
    with pytest.raises(ValueError, match="rank"):
        shard_indices(n, world, world)


def test_needs_a_process_group() -> None:
    net = tengrad_fx.prepare(torch.nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedTENGraD(net, lr=0.1, damping=0.1)


def test_choose_placement_replicates_cheap_big_layers() -> None:
    from tengrad_fx.distributed.plan import choose_placement
    dims = (1, 1, 1000, 1000)  # Linear 1000 -> 1000: u is 4 MB
    # a slow network and fast compute: recomputing beats receiving u
    assert choose_placement(64, 10 ** 6, 0.0, dims, 8, 10, bandwidth=1e8, flop_rate=1e14) == "replicate"
    # a fast network and slow compute: the owner solves and broadcasts
    assert choose_placement(64, 10 ** 6, 0.0, dims, 8, 10, bandwidth=1e12, flop_rate=1e9) == "owner"
    assert choose_placement(64, 10 ** 6, 0.0, dims, 1, 10, bandwidth=1e8, flop_rate=1e14) == "owner"


def test_mode_times_and_choose_modes() -> None:
    """The per-layer times of :func:`plan.mode_times` (by hand), and :func:`plan.choose_modes`:
    a layer that makes its owner the straggler goes ``gram-blocks``; balanced layers (one
    per rank) stay ``gather`` — splitting one would not shorten the busiest rank's step."""
    from tengrad_fx.distributed.plan import choose_modes, mode_times, step_flops
    W, m = 8, 128
    M = W * m
    conv = (1, 32 * 32, 9 * 64, 64)  # 3x3 conv 64 -> 64 on 32x32: S = 1024 positions
    n = 9 * 64 * 64 + 64
    t_gather = n * 4 / 50e9 + step_flops(M, conv) / 50e12
    t_blocks = (2 * (W - 1) / W * n * 4 + (W - 1) * m * 4 + M * 4) / 50e9 + step_flops(m, conv) / 50e12
    assert mode_times(M, n, conv, W, 50e9, 50e12) == pytest.approx((t_gather, t_blocks))
    head = (1, 1, 256, 10)  # a small Linear head
    # one big conv on rank 0, small heads on the other ranks: the conv is split, the heads are not
    modes = choose_modes(M, [n] + [2570] * (W - 1), [conv] + [head] * (W - 1), list(range(W)), W, 50e9, 50e12)
    assert modes == ["gram-blocks"] + ["gather"] * (W - 1)
    # W equal convs, one per rank: already balanced
    assert choose_modes(M, [n] * W, [conv] * W, list(range(W)), W, 50e9, 50e12) == ["gather"] * W
    # all on one rank (e.g. 2 layers, the big one first): the big one is split
    assert choose_modes(M, [n, 2570], [conv, head], [0, 0], W, 50e9, 50e12)[0] == "gram-blocks"
    assert choose_modes(m, [n], [conv], [0], 1, 50e9, 50e12) == ["gather"]  # one rank: nothing to split


def test_mode_placement_and_unsupported_options_are_checked() -> None:
    import torch.distributed as dist
    from testing.spawn import free_port
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        net = tengrad_fx.prepare(torch.nn.Linear(3, 2))
        with pytest.raises(ValueError, match="mode must be"):
            DistributedTENGraD(net, lr=0.1, damping=0.1, mode="blocks")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="placement must be"):
            DistributedTENGraD(net, lr=0.1, damping=0.1, placement="all")  # type: ignore[arg-type]
        for rows in ("curvature_samples", "position_rows"):  # the global batch's rows (test_rows.py)
            with pytest.raises(ValueError, match=f"{rows} takes rows of the global batch's Fisher"):
                DistributedTENGraD(net, lr=0.1, damping=0.1, mode="local", **{rows: 4})
            assert getattr(DistributedTENGraD(net, lr=0.1, damping=0.1, **{rows: 4}), rows) == 4
        opt = DistributedTENGraD(net, lr=0.1, damping=0.1, metric="factored", relative_damping=True)
        assert opt.metric is not None and opt.curvature.relative  # run under DDP (test_options.py)
        from tengrad_fx.optim.tengrad.metric import ROOT_EVERY, Metric
        roots = DistributedTENGraD(net, lr=0.1, damping=0.1, metric=Metric("kronecker", root_every=2)).metric
        assert roots is not None and roots.root_every == 2  # run under DDP (test_options.py)
        kron = DistributedTENGraD(net, lr=0.1, damping=0.1, metric="kronecker").metric  # root_every="auto"
        assert kron is not None and kron.root_every == ROOT_EVERY["kronecker"]  # as on one process
    finally:
        dist.destroy_process_group()
