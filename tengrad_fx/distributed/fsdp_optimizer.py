"""``FSDPTENGraD``: :class:`~.optimizer.DistributedTENGraD` over FSDP2-sharded parameters
(:class:`~.fsdp.FSDPShards`); ``DistributedTENGraD(model, ...)`` is one where the model's
parameters are DTensors.

The preconditioned updates are this rank's rows (local tensors, :mod:`.fsdp`); the shared
step (KL clip, weight decay, momentum, the masked skip) runs on the local shards of the
parameters, gradients and momentum buffers with the same kernels as single-process
TENGraD (the strategy's step primitives: :mod:`tengrad_fx.optim.step.sharding`), and the
buffers are kept as DTensors of their parameters' placements (what
``torch.distributed.checkpoint`` saves and reshards). Per parameter this rank keeps
``1/S`` of the momentum (``S`` = shard group size). ``graft``, ``orthogonalize`` and
``orthogonalize_momentum`` shape the rows first (:class:`~.fsdp_shaping.ShardedShaping`).

Setup (one process per rank, e.g. under ``torchrun``)::

    dist.init_process_group("gloo")           # or "nccl"
    for block in model.blocks:
        fully_shard(block)                     # fully_shard FIRST ...
    fully_shard(model)
    net = tengrad_fx.prepare(model, example_inputs=(x[:2],))   # ... then prepare (module surgery)
    opt = DistributedTENGraD(net, lr=..., damping=...)           # an FSDPTENGraD
"""
from __future__ import annotations

from typing import Any

import torch

from ..optim.step.param_groups import same_lr
from ..optim.tengrad.tengrad import TENGraD
from .fsdp import FSDPShards
from .fsdp_metric import ShardedMetric
from .fsdp_shaping import ShardedShaping
from .global_batch import Mode
from .optimizer import DistributedTENGraD

__all__ = ["FSDPTENGraD"]


class FSDPTENGraD(DistributedTENGraD):
    """TENGraD on an FSDP2 model (module docstring): ``TENGraD(model, lr, damping,
    distribution=FSDPShards(mode, seed, bandwidth, flop_rate), **kwargs)`` with the step on
    local shards.

    Args:
        model: ``prepare(model, example_inputs=...)`` of a model ``fully_shard`` was applied to.
        seed: the seed of the optimizer's generator on every rank (the global batch's MC labels,
            the position rows; :class:`.optimizer.DistributedTENGraD`).
        **kwargs: TENGraD's options (``graft``, ``orthogonalize`` and ``orthogonalize_momentum`` on the
            row shards: :mod:`.fsdp_shaping`; ``metric``: :mod:`.fsdp_metric`; ``relative_damping``,
            ``compile``, ``fisher="gauss-newton"``, ``curvature_samples`` and ``position_rows`` (the
            latter two gathered, or cut to the row shards under ``"gram-blocks"``) as under DDP);
            ``cuda_graph`` is not supported (``ValueError``: the static gradient buffers a replay
            reads are not made for FSDP2's DTensor gradients, :meth:`.fsdp.FSDPShards.check`).
        mode: ``"gather"`` (whole records all-gathered), ``"gram-blocks"`` (each rank receives its
            rows' cut of the records; the Gram summed from the row shards') or ``"auto"`` (per
            layer, :func:`.fsdp_exchange.choose_fsdp_modes`).
        placement: ``"auto"`` or ``"replicate"`` (every rank solves every layer for its rows).
    """

    distribution: FSDPShards
    shaping: ShardedShaping

    def __init__(self, model: torch.nn.Module, lr: float, damping: float, *, mode: Mode = "auto",
                 placement: str = "auto", seed: int = 0, bandwidth: float = 50e9, flop_rate: float = 50e12,
                 **kwargs: Any):
        if placement not in ("auto", "replicate"):
            raise ValueError("DistributedTENGraD (FSDP2): every rank solves every layer for its own rows; placement "
                             f"must be 'auto' or 'replicate', got {placement!r}")
        if "distribution" in kwargs:
            raise ValueError("DistributedTENGraD: distribution= is its own (FSDPShards); pass seed, "
                             "or use TENGraD(..., distribution=...)")
        TENGraD.__init__(self, model, lr, damping, distribution=FSDPShards(mode, seed, bandwidth, flop_rate), **kwargs)
        if self.metric is not None:  # the metric's moments and S g on the row shards
            self.metric = ShardedMetric(self.metric, self.distribution)  # type: ignore[assignment]
        sh = self.shaping
        self.shaping = ShardedShaping(sh.graft, sh.orthogonalize, sh.momentum_first, self.param_groups,
                                      self.distribution)
        if self.kl_clip is not None and not same_lr(self.param_groups):
            raise ValueError("DistributedTENGraD (FSDP2): kl_clip needs one lr for all param groups")

    def polar_owners(self) -> dict[str, int]:
        """``{layer: owner}``: the shard coordinate that computed each orthogonalized weight's
        polar factor on the last step (:func:`.plan.polar_owners`; empty without ``orthogonalize``)."""
        owners = self.shaping.owners
        return {lay.name: owners[lay.weight] for lay in self._layers if lay.weight in owners}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """TENGraD's state dict in the form ``torch.distributed.checkpoint``'s
        ``get_optimizer_state_dict`` keeps: the counters ride in the first param group
        (``"tengrad"``), not in ``state``, and every parameter of a group with momentum has
        a ``momentum_buffer`` (a DTensor of its placements; zeros before its first step,
        which the first step's ``buf = μ·0 + d`` makes ``d`` as without one), and the
        shaping's state likewise (:meth:`.fsdp_shaping.ShardedShaping.template`), so a fresh
        optimizer's state dict is the template that loads a saved one on any mesh."""
        sd = super().state_dict()
        state = dict(sd["state"])
        counters = state.pop(self.NAME)
        pid = 0
        for group in self.param_groups:
            for p in group["params"]:
                fresh = dict(self.shaping.template(p, group))
                if isinstance(self.metric, ShardedMetric):
                    fresh.update(self.metric.template(p, self._layers))
                if group["momentum"]:
                    fresh["momentum_buffer"] = torch.zeros_like(p)
                if fresh:
                    state[pid] = {**fresh, **state.get(pid, {})}
                pid += 1
        groups = [dict(g) for g in sd["param_groups"]]
        groups[0]["tengrad"] = counters
        return {**sd, "state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s form (or TENGraD's); the next step takes curvature."""
        sd = dict(state_dict)
        groups = [dict(g) for g in sd["param_groups"]]
        counters = groups[0].pop("tengrad", None) if groups else None
        if counters is not None:
            sd["state"] = {**sd["state"], self.NAME: counters}
            sd["param_groups"] = groups
        super().load_state_dict(sd)


DistributedTENGraD.sharded_class = FSDPTENGraD
