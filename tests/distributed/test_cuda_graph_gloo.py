"""``DistributedTENGraD(cuda_graph=True)`` on 2 gloo ranks (spawned, CPU, float64): the
graph path of the reuse steps (static gradient buffers, the graph runner, refilled factors)
runs eagerly off CUDA, and every step's parameters equal ``cuda_graph=False``'s bit for bit,
in the modes gather, gram-blocks, auto (mixed; also with ``metric`` and ``relative_damping``)
and local, empirical and MC, ``T = 3``.
The reuse steps read nothing back from the device (:class:`~tengrad_fx.utils.dispatch.SyncCounter`)
and draw no probe coordinates, so on NCCL they can be captured; the CUDA replay itself is
checked in ``test_cuda_graphs_dist.py``."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from testing.dist_workers import flat_params, global_batch, make_model
from testing.distributed import run_ranks

STEPS, T, M_LOCAL = 6, 3, 3
REUSE = [k for k in range(STEPS) if k % T]  # steps 1, 2, 4, 5
CASES = {
    "gather-empirical": dict(model="mlp", mode="gather", fisher="empirical"),
    "gather-mc": dict(model="mlp", mode="gather", fisher="mc"),
    "gram-blocks-empirical": dict(model="mlp", mode="gram-blocks", fisher="empirical"),
    "gram-blocks-mc": dict(model="mlp", mode="gram-blocks", fisher="mc"),
    "auto-empirical": dict(model="cnn", mode="auto", fisher="empirical"),
    "auto-mc": dict(model="cnn", mode="auto", fisher="mc"),
    "local-empirical": dict(model="mlp", mode="local", fisher="empirical"),
    "gather-one-layer": dict(model="linear", mode="gather", fisher="empirical"),  # rank 1 owns no layer
    "auto-metric-relative": dict(model="cnn", mode="auto", fisher="empirical",
                                 opts=dict(metric="kronecker", relative_damping=True)),
}


def _model(kind: str) -> torch.nn.Module:
    if kind != "linear":
        return make_model(kind)
    torch.manual_seed(0)
    return torch.nn.Linear(6, 4).double()  # the inputs and classes of "mlp"


def _probe_states(opt: Any) -> list[torch.Tensor]:
    return [g.get_state() for key, g in sorted(opt.distribution._generators.items()) if key.startswith("probe")]


def _run(rank: int, world: int, case: dict[str, Any], cuda_graph: bool) -> dict[str, Any]:
    """One training run on this rank's shard: parameters after each step, the host reads
    of each reuse step, whether a reuse step moved the probe generator, the graph runner's counts."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    from tengrad_fx.utils.dispatch import SyncCounter
    kind = "mlp" if case["model"] == "linear" else case["model"]
    net = tengrad_fx.prepare(_model(case["model"]))
    ddp = DDP(net)
    opt = DistributedTENGraD(ddp, lr=0.1, damping=0.05, mode=case["mode"], placement="owner", bandwidth=1e9,
                             flop_rate=1e10, curvature_every=T, fisher=case["fisher"], kl_clip=0.01,
                             weight_decay=1e-3, cuda_graph=cuda_graph, **case.get("opts", {}))
    traj, syncs, probe_moved = [flat_params(net)], [], []
    for k in range(STEPS):
        x, y = global_batch(kind, world * M_LOCAL, k)
        x, y = x[rank * M_LOCAL:(rank + 1) * M_LOCAL], y[rank * M_LOCAL:(rank + 1) * M_LOCAL]
        out = ddp(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        opt.mc_capture(out)
        loss.backward()
        before = _probe_states(opt)
        with SyncCounter() as sc:
            opt.step()
        probe_moved.append(any(not torch.equal(a, b) for a, b in zip(before, _probe_states(opt))))
        if k in REUSE:
            syncs.append(dict(sc.ops))
        traj.append(flat_params(net))
    runner = opt.graph_runner
    return {"traj": traj, "syncs": syncs, "probe_moved": probe_moved, "cuda_graph": opt.cuda_graph,
            "eager_runs": runner.graphs.eager_runs, "static_grads": len(runner.grads),
            "modes": sorted(set(m["mode"] for m in opt.layer_plan().values())),
            "capturable": opt.distribution.capturable, "curvature_steps": opt.curvature_steps,
            "owners": sorted(set(m["owner"] for m in opt.layer_plan().values() if m["owner"] is not None))}


def graph_ranks(rank: int, world: int) -> dict[str, Any]:
    """Every case with ``cuda_graph=True`` and ``False``; and ``cuda_graph``'s default here."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    out: dict[str, Any] = {name: {flag: _run(rank, world, case, flag) for flag in (True, False)}
                           for name, case in CASES.items()}
    net = tengrad_fx.prepare(make_model("mlp"))
    out["default"] = DistributedTENGraD(DDP(net), lr=0.1, damping=0.05).cuda_graph
    out["fsdp2"] = _fsdp2_refusal(world)
    return out


def _fsdp2_refusal(world: int) -> dict[str, Any]:
    """``cuda_graph=True`` on an FSDP2 model: the error; the default there (off)."""
    import tengrad_fx
    from tengrad_fx.distributed import DistributedTENGraD
    from testing import fsdp_workers as fw

    def model() -> torch.nn.Module:
        net = fw.make_model("block")
        fw._shard(net, {}, world)
        return tengrad_fx.prepare(net, example_inputs=(fw.global_batch("block", 2, 0)[0],))

    out: dict[str, Any] = {"error": None}
    try:
        DistributedTENGraD(model(), lr=0.1, damping=0.05, cuda_graph=True)
    except ValueError as exc:
        out["error"] = str(exc)
    opt = DistributedTENGraD(model(), lr=0.1, damping=0.05)
    out["default"], out["type"] = opt.cuda_graph, type(opt).__name__
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    d: Path = tmp_path_factory.mktemp("graphs")
    return run_ranks(graph_ranks, 2, d, timeout=300.0)


@pytest.mark.parametrize("name", list(CASES))
def test_graph_path_equals_eager_bit_for_bit(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        graph, eager = r[name][True], r[name][False]
        assert graph["cuda_graph"] is True and eager["cuda_graph"] is False
        assert graph["curvature_steps"] == eager["curvature_steps"] == 2
        for k in range(1, STEPS + 1):
            assert torch.equal(graph["traj"][k], eager["traj"][k]), f"{name}: step {k - 1} differs from the eager run"
            assert not torch.equal(graph["traj"][k], graph["traj"][k - 1]), f"{name}: step {k - 1} moved nothing"
        assert torch.equal(ranks[0][name][True]["traj"][-1], ranks[1][name][True]["traj"][-1]), "the ranks differ"


@pytest.mark.parametrize("name", list(CASES))
def test_reuse_steps_go_through_the_graph_runner_without_host_reads(ranks: list[dict[str, Any]],
                                                                    name: str) -> None:
    """Every reuse step ran through the graph runner (eagerly, off CUDA) with static gradient
    buffers, read nothing back from the device and drew no probe coordinate (a capture would
    replay them: none to replay); the eager run never entered the runner."""
    for r in ranks:
        graph, eager = r[name][True], r[name][False]
        assert graph["eager_runs"] == len(REUSE) and graph["static_grads"] > 0
        assert eager["eager_runs"] == 0 and eager["static_grads"] == 0
        assert graph["syncs"] == [{}] * len(REUSE), graph["syncs"]
        assert not any(graph["probe_moved"][k] for k in REUSE), graph["probe_moved"]


def test_cases_cover_the_modes(ranks: list[dict[str, Any]]) -> None:
    """The auto case mixes gather and gram-blocks layers; the probe generator exists (and moved
    on the empirical curvature steps) in the gram-blocks cases."""
    r = ranks[0]
    assert r["gram-blocks-empirical"][True]["probe_moved"][T] and r["auto-empirical"][True]["probe_moved"][T]
    assert not any(r["gram-blocks-mc"][True]["probe_moved"])  # MC: no push-through, no probe
    assert r["auto-empirical"][True]["modes"] == r["auto-metric-relative"][True]["modes"] == ["gather", "gram-blocks"]
    assert r["gram-blocks-empirical"][True]["modes"] == ["gram-blocks"]
    assert r["gather-mc"][True]["modes"] == ["gather"]
    assert r["gather-one-layer"][True]["owners"] == [0]  # rank 1 holds no factor, yet takes the graph path


def test_default_is_off_on_gloo(ranks: list[dict[str, Any]]) -> None:
    """``cuda_graph=None`` stays off on gloo (not capturable there; CPU parameters anyway)."""
    for r in ranks:
        assert r["default"] is False
        assert all(r[name][True]["capturable"] is False for name in CASES)


def test_fsdp2_refuses_cuda_graph_with_the_reason(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        got = r["fsdp2"]
        assert got["type"] == "FSDPTENGraD" and got["default"] is False
        assert got["error"] is not None and "cuda_graph=True" in got["error"] and "DTensor" in got["error"], got
