"""``curvature_samples=s`` with gradient accumulation on 2 gloo ranks (spawned, float64): two
micro-batches of 3 samples per rank and step. The step's global batch is its micro-batches
in order, each the ranks' micro-batches in rank order, so the update is single-process
``TENGraD``'s accumulating the same two micro-batches, each the 6-sample concatenation of
the ranks' (``≤ 1e-10`` relative per step; the ranks agree bit for bit). Mostly
``fisher="gauss-newton"``, whose micro-batches each run their per-output backwards
(``opt.mc_capture``) and keep their rows there; the empirical and MC Fisher cut the union
of a rank's micro-batches at the step.

The cut ``s`` falls inside rank 1's first micro-batch (4: rank 0's 3 and one of rank 1's;
the second micro-batch runs no backward), inside the second micro-batch (8: rank 0's first
2 there, rank 1 none; 10: rank 0's 3 and one of rank 1's), or within rank 0's first
micro-batch (2: rank 1 holds none of micro-batch 0, nobody any of micro-batch 1). DDP in
``gather`` and ``gram-blocks`` mode, ``curvature_every`` 1 and 2; FSDP2 (``fully_shard`` on
every layer) in ``gram-blocks`` mode. One spawn runs every case.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from testing.distributed import run_ranks

TOL = 1e-10
M, MICRO, STEPS = 3, 2, 4  # samples per rank and micro-batch, micro-batches per step, steps
OPTS = dict(lr=0.1, damping=0.05, momentum=0.9, weight_decay=1e-3, kl_clip=None)

CASES: dict[str, dict[str, Any]] = {
    f"ddp-{mode}-s{s}-T{T}": dict(strategy="ddp", mode=mode, samples=s, T=T)
    for mode in ("gather", "gram-blocks") for s in (4, 8, 10, 2) for T in (1, 2)
}
CASES.update({f"fsdp2-gram-blocks-s{s}-T1": dict(strategy="fsdp2", mode="gram-blocks", samples=s, T=1)
              for s in (4, 8, 2)})
CASES["ddp-gather-all-T1"] = dict(strategy="ddp", mode="gather", samples=None, T=1)  # no cut: every row
CASES.update({f"ddp-{mode}-{fisher}-s{s}-T{T}": dict(strategy="ddp", mode=mode, samples=s, T=T, fisher=fisher)
              for mode, fisher, s, T in (("gather", "empirical", 4, 1), ("gram-blocks", "empirical", 8, 2),
                                         ("gather", "mc", 8, 2), ("gram-blocks", "mc", 4, 1))})
# the per-output backwards run by the output's hook at loss.backward() (no mc_capture call)
CASES["ddp-gram-blocks-s8-T2-hooked"] = dict(strategy="ddp", mode="gram-blocks", samples=8, T=2, hooked=True)
CASES["fsdp2-gram-blocks-empirical-s4-T1"] = dict(strategy="fsdp2", mode="gram-blocks", samples=4, T=1,
                                                  fisher="empirical")


def _model(strategy: str) -> nn.Module:
    """A float64 MLP: 4 outputs (DDP's) or 5 (FSDP2's, four Linear layers)."""
    if strategy == "ddp":
        from testing.dist_workers import make_model
        return make_model("mlp")
    from testing.fsdp_workers import make_model as fsdp_model
    return fsdp_model("mlp")


def _batches(step: int, world: int) -> list[torch.Tensor]:
    """Step ``step``'s global micro-batches, each ``[world·M, 6]`` (the ranks' in rank order)."""
    g = torch.Generator().manual_seed(3000 + step)
    return [torch.randn(world * M, 6, generator=g, dtype=torch.float64) for _ in range(MICRO)]


def _options(case: dict[str, Any]) -> dict[str, Any]:
    return dict(OPTS, curvature_every=case["T"], curvature_samples=case["samples"],
                fisher=case.get("fisher", "gauss-newton"))


def _params(net: nn.Module) -> torch.Tensor:
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                      for p in net.parameters()]).clone()


def _train(opt: Any, fwd: nn.Module, net: nn.Module, micro: list[list[torch.Tensor]], hooked: bool = False
           ) -> list[torch.Tensor]:
    """Each step: per micro-batch ``mc_capture`` (``hooked``: none, the output's hook runs it)
    and the backward of its mean squared error (against ``sin`` of its first inputs) over the
    micro-batches' count; then ``opt.step()``. The parameters after each step."""
    traj = [_params(net)]
    for xs in micro:
        opt.zero_grad()
        for x in xs:
            out = fwd(x)
            if not hooked:
                opt.mc_capture(out)
            (F.mse_loss(out, torch.sin(x[:, :out.shape[1]])) / len(xs)).backward()
        opt.step()
        traj.append(_params(net))
    return traj


def accumulated_ranks(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, list[torch.Tensor]]:
    """Every case on this rank (its slice of each global micro-batch): the parameters after each step."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    out = {}
    for name, case in cases.items():
        net = _model(case["strategy"])
        if case["strategy"] == "ddp":
            net = tengrad_fx.prepare(net)
            fwd: nn.Module = DDP(net)
        else:
            from testing.fsdp_workers import _shard
            _shard(net, {"shard": "layers"}, world)
            fwd = net = tengrad_fx.prepare(net, example_inputs=(torch.zeros(2, 6, dtype=torch.float64),))
        opt = DistributedTENGraD(fwd, mode=case["mode"], **_options(case))
        micro = [[x[rank * M:(rank + 1) * M] for x in _batches(k, world)] for k in range(STEPS)]
        out[name] = _train(opt, fwd, net, micro, case.get("hooked", False))
    return out


def _single(case: dict[str, Any], world: int) -> list[torch.Tensor]:
    """Single-process TENGraD accumulating the global micro-batches (each ``world·M`` samples)."""
    import tengrad_fx
    net = tengrad_fx.prepare(_model(case["strategy"]))
    opt = tengrad_fx.TENGraD(net, **_options(case))
    opt.seed_mc(0)  # MC labels: DistributedTENGraD seeds its generator with its seed, 0
    return _train(opt, net, net, [_batches(k, world) for k in range(STEPS)])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[torch.Tensor]]]:
    d: Path = tmp_path_factory.mktemp("accumulated_rows")
    return run_ranks(accumulated_ranks, 2, d, CASES, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_accumulated_rows_are_the_global_batch_ones(ranks: list[dict[str, list[torch.Tensor]]], name: str) -> None:
    ref = _single(CASES[name], 2)
    got = [r[name] for r in ranks]
    for k in range(1, STEPS + 1):
        d, dr = got[0][k] - got[0][k - 1], ref[k] - ref[k - 1]
        err = ((d - dr).norm() / dr.norm()).item()
        assert err <= TOL, f"step {k - 1}: relative error {err:.2e} of the update vs the accumulated global batch's"
        assert torch.equal(got[1][k], got[0][k]), f"the ranks differ after step {k - 1}"


def test_the_cut_changes_the_update(ranks: list[dict[str, list[torch.Tensor]]]) -> None:
    """The first samples' Fisher is not the whole batch's (the comparisons above see the cut)."""
    first, whole = ranks[0]["ddp-gather-s4-T1"], ranks[0]["ddp-gather-all-T1"]
    assert ((first[1] - whole[1]).norm() / (whole[1] - whole[0]).norm()).item() > 1e-3
