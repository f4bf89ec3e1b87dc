"""``graft``, ``orthogonalize`` and ``orthogonalize_momentum`` on FSDP2 row shards.

Each rank holds rows ``R_r`` of every update ``u`` (:mod:`.fsdp`). The shaping of
single-process TENGraD (:mod:`tengrad_fx.optim.tengrad.shaping`, the same order and
param-group opt-outs) runs on those local rows, except for what needs a whole parameter:

* ``graft``: each parameter's ``u`` is rescaled to the norm of SGD's or RMSProp's step over
  the whole parameter: ``‖x‖ = √(Σ_r ‖x_r‖²)``, the squared norms of every grafted
  parameter's direction and update summed over the shard group in one ``all_reduce``.
  RMSProp's second moments are elementwise (each rank keeps its rows'); its moments move
  only when every rank's gradient shards are finite (one ``all_reduce`` of that flag).
* ``orthogonalize``: the polar factor of each weight ``U [out, in·k…]`` is computed on one
  rank, its owner (:func:`.plan.polar_owners`: balanced by the polar factor's size).
  One ``all_to_all`` over the shard group takes every rank's rows of each weight to its
  owner, which stacks them into ``U`` and runs the single-process function on it
  (:func:`tengrad_fx.optim.tengrad.graft.orthogonalize_updates`, its weights of one shape
  batched as there); a second ``all_to_all`` sends each rank its rows of the result. No
  rank computes the polar factor of a weight it does not own.
* ``orthogonalize_momentum``: Muon's momentum before the polar factor is elementwise:
  each rank keeps its rows' (a DTensor of the weight's placements, as every state here).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..optim.step.update import finite_flag
from ..optim.tengrad.graft import GRAFT_BETA2, GRAFT_EPS, GRAFT_SQ, GRAFT_T, graft_updates, orthogonalize_updates
from ..optim.tengrad.shaping import POLAR_MOMENTUM, UpdateShaping
from .comm import all_ok, collective
from .fsdp_rows import like, local, row_chunk, row_range
from .plan import polar_owners

__all__ = ["ShardedShaping", "owner_polar"]


class ShardedShaping(UpdateShaping):
    """:class:`~tengrad_fx.optim.tengrad.shaping.UpdateShaping` on the local rows of
    DTensor parameters (module docstring). Arguments as its, and ``shards``: the
    :class:`~.fsdp.FSDPShards` whose shard group and coordinates the exchanges use.
    :attr:`owners`: each orthogonalized weight's owner (shard coordinate), as of the last step."""

    def __init__(self, graft: Optional[str], orthogonalize: Any, orthogonalize_momentum: bool,
                 groups: list[dict[str, Any]], shards: Any):
        super().__init__(graft, orthogonalize, orthogonalize_momentum, groups)
        self.shards = shards
        self.owners: dict[Tensor, int] = {}

    def shape(self, result: Any, groups: list[dict[str, Any]], params: list[Tensor], state: Any) -> Any:
        """:meth:`UpdateShaping.shape` on the local shards of the state (updated in place);
        state it creates is kept as DTensors of the parameters' placements."""
        views = {p: {k: local(v) for k, v in state.get(p, {}).items()} for p in params}
        out = super().shape(result, groups, params, views)
        for p in params:
            for k, v in views[p].items():
                if k not in state.get(p, {}):
                    state[p][k] = like(p, v) if isinstance(v, Tensor) and v.ndim == p.ndim and v.ndim else v
        return out

    def template(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """The shaping state of ``p`` (a parameter of ``group``) before its first step, as
        zeros, which the first step reads as it reads none: Muon's momentum of an
        orthogonalized weight, RMSProp's ``v`` and ``t`` of a grafted parameter (a template
        that ``torch.distributed.checkpoint`` loads a saved state into)."""
        if self.orthogonalize and group.get("orthogonalize", True) and p.ndim >= 2:
            return {POLAR_MOMENTUM: torch.zeros_like(p)} if self.momentum_first else {}
        if self.graft == "rmsprop":
            return {GRAFT_SQ: torch.zeros_like(p), GRAFT_T: torch.zeros((), dtype=p.dtype, device=local(p).device)}
        return {}

    def _graft(self, updates: dict[Tensor, Tensor], kept: list[Tensor], state: Any) -> dict[Tensor, Tensor]:
        """:func:`~tengrad_fx.optim.tengrad.graft.graft_updates` on the local shards, the
        norms over the whole parameters, RMSProp's flag agreed by all ranks."""
        assert self.graft is not None
        ok = None
        held = [p for p in kept if p.grad is not None]  # the same on every rank
        if self.graft == "rmsprop" and held:
            flag = finite_flag([local(g) for p in held if (g := p.grad) is not None])  # None: no rows here
            ok = all_ok(flag if flag is not None else torch.ones((), dtype=torch.bool, device=local(held[0]).device))
        return graft_updates(updates, kept, state, self.graft, GRAFT_BETA2, GRAFT_EPS, grad=_local_grad,
                             norms=self._norms, ok=ok)

    def _norms(self, ts: list[Tensor]) -> list[Tensor]:
        """``‖t‖`` of the whole parameters whose local shards are ``ts``: the local squared
        norms summed over the shard group (one ``all_reduce``, in float64)."""
        if not ts:
            return []
        sq = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(ts)]).square()
        group = self.shards.shard_group
        collective("sum of the row shards' squared norms (graft)", lambda: dist.all_reduce(sq, group=group))
        return [s.sqrt().to(t.dtype) for s, t in zip(sq.unbind(0), ts)]

    def _orthogonalize(self, updates: dict[Tensor, Tensor], polar: list[Tensor]) -> dict[Tensor, Tensor]:
        """The polar factors of ``polar`` (DTensor weights, the groups' order), each computed
        by its owner: :func:`owner_polar`."""
        assert self.orthogonalize
        sh = self.shards
        out, owners = owner_polar(updates, polar, self.orthogonalize, sh.shard_group, sh._coords[sh.rank],
                                  sh._shards, sh.sharing.add_param_bytes)
        self.owners = dict(zip(polar, owners))
        return {**updates, **out}


def _local_grad(p: Tensor) -> Optional[Tensor]:
    return local(p.grad) if p.grad is not None else None


def owner_polar(updates: dict[Tensor, Tensor], weights: Sequence[Tensor], method: str, group: Any, coord: int,
                shards: int, count: Optional[Callable[[Tensor, int], None]] = None
                ) -> tuple[dict[Tensor, Tensor], list[int]]:
    """This rank's rows of the polar factor of every weight in ``weights`` (DTensors, the
    same list on every rank of the shard group; ``updates[p]``: this rank's rows of ``p``'s
    update) and each weight's owner (:func:`.plan.polar_owners`). ``coord``: this rank's
    coordinate on the shard dim (its rank in ``group``), ``shards`` the group's size; one
    pair of ``all_to_all`` per dtype (module docstring). ``count(p, nbytes)``: the bytes
    this rank sends of each weight (its rows to the owner; an owner, the others' rows back)."""
    mats = [(p.shape[0], math.prod(p.shape[1:])) for p in weights]
    owners = polar_owners(mats, shards)
    out: dict[Tensor, Tensor] = {}
    for dtype in sorted({updates[p].dtype for p in weights}, key=str):
        idx = [i for i, p in enumerate(weights) if updates[p].dtype == dtype]
        out.update(_exchange_polar([weights[i] for i in idx], [owners[i] for i in idx], updates, method, group,
                                   coord, shards))
    if count is not None:
        for p, (_, cols), owner in zip(weights, mats, owners):
            a, b = row_range(p)
            count(p, (p.shape[0] - (b - a) if owner == coord else b - a) * cols * updates[p].element_size())
    return out, owners


def _exchange_polar(weights: list[Tensor], owners: list[int], updates: dict[Tensor, Tensor], method: str,
                    group: Any, coord: int, shards: int) -> dict[Tensor, Tensor]:
    """:func:`owner_polar` for weights of one dtype: rows to the owners, the owner's polar
    factors, rows back."""
    cols = [math.prod(p.shape[1:]) for p in weights]
    rows = [[row_chunk(p.shape[0], shards, d) for d in range(shards)] for p in weights]
    for p, r in zip(weights, rows):
        if row_range(p) != r[coord]:
            raise ValueError(f"DistributedTENGraD (FSDP2): a weight of shape {tuple(p.shape)} holds rows "
                             f"{row_range(p)} here, not torch.chunk's {r[coord]}; the polar factor's exchange "
                             "needs fully_shard's even dim-0 chunks")
    mine = [i for i, o in enumerate(owners) if o == coord]

    def size(i: int, d: int) -> int:  # elements of weight i on shard d
        return (rows[i][d][1] - rows[i][d][0]) * cols[i]

    # to each owner, this rank's rows of the weights it owns
    send = [updates[weights[i]].reshape(-1) for d in range(shards) for i in range(len(weights)) if owners[i] == d]
    in_splits = [sum(size(i, coord) for i in range(len(weights)) if owners[i] == d) for d in range(shards)]
    out_splits = [sum(size(i, d) for i in mine) for d in range(shards)]
    ref = updates[weights[0]]
    got = _all_to_all(send, in_splits, out_splits, ref, group, "the row shards of the updates to their polar owners")
    parts = [src.split([size(i, d) for i in mine]) for d, src in enumerate(got.split(out_splits))]
    whole = {weights[i]: torch.cat([parts[d][k] for d in range(shards)]).view(weights[i].shape)
             for k, i in enumerate(mine)}
    q = orthogonalize_updates(whole, method, only=set(whole)) if whole else {}
    # back: to each rank, its rows of the polar factors owned here
    back = [q[weights[i]].reshape(weights[i].shape[0], -1)[slice(*rows[i][d])].reshape(-1)
            for d in range(shards) for i in mine]
    got = _all_to_all(back, out_splits, in_splits, ref, group, "the polar factors' row shards to their ranks")
    res: dict[Tensor, Tensor] = {}
    for d, src in enumerate(got.split(in_splits)):
        theirs = [i for i in range(len(weights)) if owners[i] == d]
        for i, part in zip(theirs, src.split([size(i, coord) for i in theirs])):
            res[weights[i]] = part.view(updates[weights[i]].shape)
    return res


def _all_to_all(parts: list[Tensor], in_splits: list[int], out_splits: list[int], ref: Tensor, group: Any,
                what: str) -> Tensor:
    """The concatenation of ``parts`` sent to the ranks of ``group`` by ``in_splits``; the
    ``out_splits`` parts received, concatenated (``ref``'s dtype and device)."""
    flat = torch.cat(parts) if parts else ref.new_empty(0)
    out = ref.new_empty(sum(out_splits))
    collective(what, lambda: dist.all_to_all_single(out, flat, out_splits, in_splits, group=group))
    return out
