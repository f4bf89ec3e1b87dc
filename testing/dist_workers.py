"""Training runs of the distributed tests: the same small float64 models and global
batches on ``W`` ranks (:func:`train_ranks`, run through :func:`testing.distributed.run_ranks`)
and in one process on the concatenated batch (:func:`train_single`, the reference).

A run is described by a ``cfg`` dict: ``model`` ("mlp", "mlp2", "mlp3" or "cnn"), ``m`` (local batch),
``steps``, ``T`` (curvature_every), ``fisher``, ``kl_clip``, ``metric``, ``relative`` (relative_damping),
``placement`` (default ``"owner"``), ``mode`` (default ``"gather"``), ``bandwidth``/``flop_rate`` (the cost
model's, for ``"auto"``), ``sequential`` (no overlap of communication and work), and optional
``inside`` (``prepare(DDP(model))`` instead of ``DDP(prepare(model))``), and optional
faults: ``short_rank`` (that rank's batch has one sample fewer; with ``expect_error`` the
``ValueError`` each rank raised is returned), ``nan_rank``/``nan_step`` (that rank's gradient gets a NaN after DDP's
averaging), ``raise_rank``/``raise_step`` (that rank raises after its backward, before its step), plus
``save``/``load`` (a checkpoint path written by rank 0 after the last step / loaded
before the first) and ``start`` (index of the first global batch).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["make_model", "global_batch", "train_ranks", "train_single", "flat_params", "local_fisher_reference"]

SHAPES = {"mlp": (6,), "mlp2": (6,), "mlp3": (6,), "cnn": (3, 6, 6)}


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 4))
    elif kind == "mlp2":  # two layers: with 3 ranks, one rank owns none
        net = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))
    elif kind == "mlp3":  # two 8 -> 8 layers: one group of equal shapes
        net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(),
                            nn.Linear(8, 4))
    else:
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
                            nn.Conv2d(4, 4, 3, groups=2, stride=2, bias=False), nn.ReLU(),
                            nn.Flatten(), nn.Linear(4 * 2 * 2, 4))
    return net.double()


def global_batch(kind: str, M: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(M, *SHAPES[kind], generator=g, dtype=torch.float64), torch.randint(0, 4, (M,), generator=g)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def mc_step(opt: Any, out: torch.Tensor, loss: torch.Tensor, scaler: Any = None) -> Optional[torch.Tensor]:
    """One training step after the forward: ``opt.mc_capture(out)``, the backward of
    ``loss`` (through ``scaler`` if given) and ``opt.step()``; the MC labels the optimizer
    drew (``last_mc_targets``, then cleared; None where it keeps none)."""
    opt.zero_grad()
    opt.mc_capture(out)
    drawn = getattr(opt, "last_mc_targets", None)
    if hasattr(opt, "last_mc_targets"):
        opt.last_mc_targets = None
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()
    return drawn


def _opt_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    return dict(lr=0.1, damping=0.05, momentum=0.9, weight_decay=1e-3, curvature_every=cfg.get("T", 1),
                fisher=cfg.get("fisher", "empirical"), kl_clip=cfg.get("kl_clip"), graft=cfg.get("graft"),
                orthogonalize=cfg.get("orthogonalize", False), metric=cfg.get("metric"),
                relative_damping=cfg.get("relative", False))


def last_group(net: nn.Module) -> dict[str, Any]:
    """The last Linear's parameters as a group of their own lr, damping and momentum."""
    return {"params": [p for n, p in net.named_parameters() if n.startswith("4.")], "lr": 0.05, "damping": 0.3,
            "momentum": 0.5}


def param_groups(net: nn.Module, cfg: dict[str, Any]) -> dict[str, Any]:
    """With ``cfg["groups"]``: ``params=`` of two groups (:func:`last_group` and the rest;
    with ``cfg["add_at"]`` the rest only, :func:`add_group` adds the last); else no keyword."""
    if not cfg.get("groups"):
        return {}
    rest = [{"params": [p for n, p in net.named_parameters() if not n.startswith("4.")]}]
    return {"params": rest if "add_at" in cfg else rest + [last_group(net)]}


def add_group(opt: Any, net: nn.Module, cfg: dict[str, Any], step: int) -> None:
    """``opt.add_param_group(last_group(net))`` before step ``cfg["add_at"]``."""
    if cfg.get("add_at") == step:
        opt.add_param_group(last_group(net))


def train_ranks(rank: int, world: int, cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``cfg`` in turn on this rank; per cfg: parameters after each step, the MC
    targets of each step, final momentum buffers and counters."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    out = []
    for cfg in cfgs:
        if cfg.get("expect_error"):  # every rank must raise the same clear error, none hang
            try:
                train_ranks(rank, world, [{k: v for k, v in cfg.items() if k != "expect_error"}])
            except ValueError as exc:
                out.append({"error": str(exc)})
                continue
            raise AssertionError("no error raised")
        kind, m = cfg["model"], cfg["m"]
        if cfg.get("inside"):  # prepare(DDP(model)): surgery inside the wrapper
            ddp = net = tengrad_fx.prepare(DDP(make_model(kind)), example_inputs=(global_batch(kind, 2, 0)[0],))
        else:
            net = tengrad_fx.prepare(make_model(kind))
            ddp = DDP(net)
        opt = DistributedTENGraD(ddp, placement=cfg.get("placement", "owner"), mode=cfg.get("mode", "gather"),
                                 seed=cfg.get("seed", 0), bandwidth=cfg.get("bandwidth", 50e9),
                                 flop_rate=cfg.get("flop_rate", 50e12), **_opt_kwargs(cfg), **param_groups(net, cfg))
        opt.distribution.overlap = not cfg.get("sequential", False)
        if cfg.get("load"):
            ck = torch.load(cfg["load"], weights_only=False)
            net.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
        traj, targets = [flat_params(net)], []
        for k in range(cfg["steps"]):
            x, y = global_batch(kind, world * m, cfg.get("start", 0) + k)
            x, y = x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]
            add_group(opt, net, cfg, k)
            if cfg.get("short_rank") == rank:  # this rank trains on one sample fewer
                x, y = x[1:], y[1:]
            out_ = ddp(x)
            loss = F.cross_entropy(out_, y)
            opt.zero_grad()
            opt.mc_capture(out_)
            targets.append(opt.last_mc_targets if cfg.get("fisher") == "mc" else None)
            opt.last_mc_targets = None
            loss.backward()
            if cfg.get("raise_rank") == rank and cfg.get("raise_step") == k:
                raise RuntimeError(f"injected failure on rank {rank} at step {k}")
            if cfg.get("nan_rank") == rank and cfg.get("nan_step") == k:
                next(net.parameters()).grad[0].fill_(float("nan"))
            opt.step()
            traj.append(flat_params(net))
        if cfg.get("save"):
            if rank == 0:
                torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, cfg["save"])
            torch.distributed.barrier()  # written before any rank loads it
        bufs = [opt.state[p]["momentum_buffer"].clone() for p in net.parameters() if "momentum_buffer" in opt.state[p]]
        out.append({"traj": traj, "targets": targets, "bufs": bufs, "counters": opt.counters,
                    "owner": dict(opt.distribution.owner), "plan": opt.layer_plan(), "bytes": dict(opt.comm_bytes)})
    return out


def train_single(cfg: dict[str, Any], world: int, targets: Optional[list[Optional[torch.Tensor]]] = None,
                 ) -> list[torch.Tensor]:
    """The reference: plain TENGraD on the concatenated batches (``world·m`` samples), its
    generator seeded as the ranks' (MC labels drawn alike; ``targets[k]``: given labels);
    parameters after each step."""
    import tengrad_fx
    kind, M = cfg["model"], world * cfg["m"]
    net = tengrad_fx.prepare(make_model(kind))
    opt = tengrad_fx.TENGraD(net, **_opt_kwargs(cfg), **param_groups(net, cfg))
    opt.seed_mc(cfg.get("seed", 0))  # MC labels: DistributedTENGraD seeds its generator with seed
    traj = [flat_params(net)]
    for k in range(cfg["steps"]):
        x, y = global_batch(kind, M, cfg.get("start", 0) + k)
        add_group(opt, net, cfg, k)
        out = net(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        opt.mc_capture(out, targets[k] if targets is not None else None)
        loss.backward()
        opt.step()
        traj.append(flat_params(net))
    return traj


def local_fisher_reference(cfg: dict[str, Any], world: int) -> torch.Tensor:
    """``mode="local"``'s first-step ``u`` computed in one process: for each rank's shard,
    plain TENGraD on that shard with the gradient replaced by the global batch's (so
    ``u_r = (F_r + αI)⁻¹ g``), read off the step (``Δw = −lr·(u + λw)`` on a first
    step); the mean over the shards."""
    import tengrad_fx
    kind, m = cfg["model"], cfg["m"]
    kw = _opt_kwargs(cfg)
    x, y = global_batch(kind, world * m, cfg.get("start", 0))
    full = make_model(kind)
    F.cross_entropy(full(x), y).backward()
    g = [p.grad.clone() for p in full.parameters()]
    us = []
    for r in range(world):
        net = tengrad_fx.prepare(make_model(kind))
        opt = tengrad_fx.TENGraD(net, **kw)
        F.cross_entropy(net(x[r * m:(r + 1) * m]), y[r * m:(r + 1) * m]).backward()
        for p, gp in zip(net.parameters(), g):
            p.grad.copy_(gp)
        w0 = flat_params(net)
        opt.step()
        us.append((w0 - flat_params(net)) / kw["lr"] - kw["weight_decay"] * w0)
    return torch.stack(us).mean(0)
