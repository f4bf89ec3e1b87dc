"""``DistributedTENGraD`` on NCCL replays its reuse steps as CUDA graphs (one GPU, one
process: an NCCL process group of world size 1 through a file store, a small float32 MLP
under DDP, ``T = 4``, 8 steps): the collectives of the reuse step (the owners' ``u``
broadcasts, the gram-blocks all-gather, broadcast and all-reduce, the local mode's
all-reduce, the finite flag's all-reduce) are captured, the graph replays, and the
parameters equal those of ``cuda_graph=False`` (eager) to ``1e-6``. Skipped without CUDA
(the same code path runs eagerly on gloo CPUs in ``test_cuda_graph_gloo.py``)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                                reason="needs a CUDA device and NCCL")

STEPS, T, M = 8, 4, 16


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """An NCCL process group of this process alone (rank 0 of 1), destroyed afterwards."""
    store: Path = tmp_path_factory.mktemp("nccl") / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(mode: str, cuda_graph: Optional[bool]) -> tuple[list[torch.Tensor], Any, list[str]]:
    """Parameters after each step, the optimizer, and the warnings raised."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    torch.manual_seed(0)
    net = tengrad_fx.prepare(nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.ReLU(),
                                           nn.Linear(16, 5)).cuda())
    ddp = DDP(net, device_ids=[0])
    opt = DistributedTENGraD(ddp, lr=0.05, damping=0.1, mode=mode, placement="owner", curvature_every=T,
                             weight_decay=1e-4, cuda_graph=cuda_graph)
    gen = torch.Generator(device="cuda").manual_seed(1)
    traj = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            x = torch.randn(M, 12, device="cuda", generator=gen)
            y = torch.randint(0, 5, (M,), device="cuda", generator=gen)
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            traj.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone())
    torch.cuda.synchronize()
    return traj, opt, [str(w.message) for w in caught]


@pytest.mark.parametrize("mode", ["gather", "gram-blocks", "local"])
def test_reuse_steps_replay_and_equal_eager(nccl_group: None, mode: str) -> None:
    graph_traj, opt, msgs = _train(mode, None)  # the default: on for NCCL and CUDA parameters
    assert opt.cuda_graph is True and opt.distribution.capturable is True
    graphs = opt.graph_runner.graphs
    assert not graphs.failed and not any("cuda_graph" in m for m in msgs), msgs
    # per curvature interval (steps 0-3, 4-7): curvature step, warm-up (eager), capture + replay, replay
    assert graphs.replays == 4 and graphs.eager_runs == 2, (graphs.replays, graphs.eager_runs)
    eager_traj, eager_opt, _ = _train(mode, False)
    assert eager_opt.graph_runner.graphs.replays == 0
    for k, (a, b) in enumerate(zip(graph_traj, eager_traj)):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), f"{mode}: step {k}: {(a - b).abs().max().item():.2e}"
    assert not torch.equal(graph_traj[-1], graph_traj[T - 1])  # the replayed steps moved the parameters
