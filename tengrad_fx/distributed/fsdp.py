"""TENGraD on models sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): the
:class:`FSDPShards` distribution, each rank computing its own rows of every update.

Parameters are DTensors sharded on dim 0 over the mesh's shard dim (``[Shard(0)]``, or
``[Replicate(), Shard(0)]`` for HSDP); rank ``r`` holds rows ``R_r`` of every weight and
its gradient ``g_r`` (FSDP's reduce-scatter of the global batch's mean gradient). Per
curvature step, per layer (``mode``; ``"auto"``: :func:`.fsdp_exchange.choose_fsdp_modes`):

* ``"gather"``: every rank all-gathers the layer's records ``(I, G)`` over all data-parallel
  ranks (``M = W·m`` samples, rank order, ``G`` rescaled by ``1/W``: :mod:`.records`) and
  builds the ``M × M`` Gram (TENGraD's own groups; the same on every rank), then cuts the
  records to its rows (:mod:`.fsdp_rows`: ``G[..., R_r]`` for Linear, ``I[..., R_r]`` for a
  transposed one, ``G[:, R_r]`` for a convolution, ``I[:, R_r]`` for a transposed one);
* ``"gram-blocks"``: every rank receives only its rows' cut of every rank's records (one
  all_to_all per dtype, :mod:`.fsdp_exchange`), forms ``J_r J_rᵀ`` and one all_reduce over
  the shard group gives ``K = Σ_r J_r J_rᵀ`` (:class:`RowGroup`); with ``curvature_samples``
  or ``position_rows`` the records are each rank's part of the global batch's ``k`` rows
  (``M = k``), cut alike (``"auto"`` gathers them).

Then it factorizes ``K + MαI`` and keeps only the factors and its rows of the records.

Every step (curvature and reuse) then, per layer, with ``J_r`` the per-sample gradients'
columns of rows ``R_r``::

    J g  = Σ_r J_r g_r                  (one all_reduce of the [L, M] partial sums over the shard group)
    c    = (K + MαI)⁻¹ J g               (the cached factors, on every rank)
    u_r  = (g_r − J_rᵀ c) / α            (this rank's rows only; for Linear Σ_i c_i G_i[:, R_r]ᵀ I_i)

(the Woodbury form on every step, curvature steps included: the push-through form would
need a probe over the whole gradient) so no rank forms a full parameter, gradient or update; the KL clip's ``Σ u·g`` and
``Σ‖g‖²`` are two more values of one all_reduce, the step's finite flag one more
all_reduce over all ranks. Momentum buffers are DTensors sharded like their parameters
(the shared step runs on the local shards: :meth:`FSDPShards.momentum_step`); ``graft``
and the polar factor run on the rows too, each weight's polar factor on one owner rank
(:mod:`.fsdp_shaping`).

Order: ``fully_shard`` first, then ``tengrad_fx.prepare(model, example_inputs=...)``:
``prepare`` then swaps the covered modules in place (module surgery) so FSDP's hooks still
gather each module's parameters for its forward and backward, and the capture ops read
those unsharded parameters. The other order is refused with a ValueError where it cannot
work (an fx-prepared graph reads the parameters directly, so a ``fully_shard`` on a
submodule never gathers them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..curvature.layer import CoveredLayer
from ..optim.step.result import StepResult
from ..optim.step.sharding import shard_momentum_step
from ..optim.tengrad.distribution import Host, SingleProcess
from ..optim.tengrad.group_build import build_groups
from ..optim.tengrad.layer_groups import LayerGroup
from .comm import all_ok, collective
from .fsdp_exchange import Cut, choose_fsdp_modes, exchange_rows, shard_coordinates
from .fsdp_unsharded import unsharded_weights
from .fsdp_rows import check_shardable, layer_rows, like, local, per_sample_only, row_records
from .global_batch import GlobalBatch, Mode
from .records import REPLICATED, check_records, gather_records
from .shard_groups import ShardRows

__all__ = ["FSDPShards", "RowGroup", "fsdp_modules"]


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The modules of ``model`` that ``fully_shard`` wrapped."""
    return [mod for mod in model.modules() if isinstance(mod, FSDPModule)]


def _shard_dim(p: DTensor, name: str) -> int:
    """The mesh dim ``p`` is sharded over (on tensor dim 0); ``ValueError`` otherwise."""
    placements = p.placements
    dims = [d for d, pl in enumerate(placements) if isinstance(pl, Shard) and pl.dim == 0]
    if len(dims) != 1 or \
            not all(isinstance(pl, Replicate) for d, pl in enumerate(placements) if d != dims[0]):
        raise ValueError(f"DistributedTENGraD (FSDP2): parameter of layer '{name}' has placements {placements}; "
                         "expected fully_shard's Shard(0) on one mesh dim (Replicate on the others, HSDP)")
    return dims[0]


@dataclass(eq=False)
class RowGroup(LayerGroup):
    """``gram-blocks`` layers: only their Grams ``K [L, M, M]`` (summed from the row shards')
    and, once factorized, the factors; the products run on the row records."""

    form: ClassVar[str] = "row-blocks"
    K: Optional[Tensor] = None

    def gram(self) -> Tensor:
        assert self.K is not None, "RowGroup: released"
        return self.K

    def release(self) -> None:
        self.K = None


class FSDPShards(GlobalBatch):
    """TENGraD's distribution over FSDP2-sharded parameters (module docstring): the global
    batch's Fisher blocks, every rank solving every layer for its own rows. Arguments as
    :class:`~.optimizer.DistributedTENGraD`'s ``seed``, ``bandwidth``, ``flop_rate``."""

    def __init__(self, mode: Mode = "auto", seed: int = 0, bandwidth: float = 50e9, flop_rate: float = 50e12):
        if mode not in ("auto", "gather", "gram-blocks"):  # "local" is DDP's only
            raise ValueError("DistributedTENGraD (FSDP2): mode must be 'auto', 'gather' or 'gram-blocks', "
                             f"got {mode!r}")
        super().__init__("gather", "replicate", seed, bandwidth, flop_rate)
        self.mode = mode
        self.shard_group: Optional[Any] = None  # the process group of the mesh's shard dim
        self._coords: list[int] = []  # each global rank's coordinate on the shard dim
        self._shards = 1  # the shard dim's size
        self._row_groups: list[LayerGroup] = []  # the cached layers' records cut to this rank's rows (group order)
        self._row_parts: dict[str, Cut] = {}  # gram-blocks layers: this rank's cut
        self._modules: list[FSDPModule] = []  # the model's FSDP modules (unwrap)
        self._unsharded: dict[Tensor, Tensor] = {}  # sharded weight -> FSDP's unsharded parameter of it

    def forget(self) -> None:
        super().forget()
        self._row_groups = []

    LABEL = "DistributedTENGraD (FSDP2)"
    STATIC_BUFFERS = ("a replayed reuse step reads the gradients from static buffers, and FSDP2's gradients "
                      "are DTensors that its reduce-scatter allocates anew on every backward, which the graph "
                      "runner's buffer copy does not handle (DTensor has no sharding rule for "
                      "aten._foreach_copy_); leave it False or None (off under FSDP2)")

    def lacks(self) -> dict[str, str]:
        """What FSDP2's row shards do not provide: the global batch's kept rows, static gradient buffers."""
        return {**super().lacks(), "static_buffers": self.STATIC_BUFFERS}

    def backward_inputs(self, opt: Host, weights: list[Tensor]) -> list[Tensor]:
        """The unsharded parameters the forward's graph read (:mod:`.fsdp_unsharded`): a
        backward asked for the sharded ones would skip every layer with no other input of the
        graph behind it, e.g. a first layer resharded after its forward, whose ``G`` would
        then never be recorded."""
        return unsharded_weights(self._modules, weights, self._unsharded)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with every FSDP module resharded (a forward, e.g. ``prepare``'s check,
        may leave the root's parameters gathered): the optimizer holds the sharded ones."""
        self._modules = fsdp_modules(model)
        for mod in self._modules:
            mod.reshard()
        return model

    def bind(self, opt: Host) -> None:
        """Checks: a mean loss, every parameter a DTensor sharded on dim 0, every covered
        layer of a kind cut by rows, the layers' parameters on one mesh; an fx-prepared model
        with ``fully_shard`` on submodules is refused (their hooks would never run)."""
        super().bind(opt)
        info = opt._info
        # the covered parameters as the optimizer holds them (prepare's check ran forwards, which
        # may have left the root's gathered ones registered): whether gradients are held is read here
        info.store.params = [p for spec in info.layers for p in (spec.weight, spec.bias) if p is not None]
        if info.method != "surgery":
            model = getattr(opt, "model", None)
            subs = [] if model is None else [mod for mod in fsdp_modules(model) if mod is not model]
            if subs:
                raise ValueError("DistributedTENGraD (FSDP2): the model was prepared by torch.fx and fully_shard was "
                                 "applied to its submodules afterwards; the traced graph reads their parameters "
                                 "directly, so FSDP never gathers them. Call fully_shard on the submodules and the "
                                 "root first, then tengrad_fx.prepare(model, example_inputs=...)")
        meshes = set()
        for lay in opt._layers:
            check_shardable(lay)
            for p in lay.params:
                if not isinstance(p, DTensor):
                    raise ValueError(f"DistributedTENGraD (FSDP2): layer '{lay.name}' has a parameter that is not "
                                     "a DTensor; fully_shard every module whose parameters are optimized")
                dim = _shard_dim(p, lay.name)
                mesh = p.device_mesh
                meshes.add((mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), dim))
                self.shard_group = mesh.get_group(dim)
                self._coords, self._shards = shard_coordinates(mesh, dim), mesh.size(dim)
        if len(meshes) > 1:
            raise ValueError("DistributedTENGraD (FSDP2): the covered layers' parameters live on different device "
                             "meshes (ranks or shard dims); shard them all on one mesh")

    # ------------------------------------------------------------------ step
    def _exchange_records(self, opt: Host) -> None:
        """Every rank gets the global batch's records of every captured layer: whole
        (``gather``: one bucketed all_gather per dtype) or cut to its rows (``gram-blocks``:
        one all_to_all per dtype, :mod:`.fsdp_exchange`), per layer by :func:`choose_fsdp_modes`."""
        layers = opt._layers
        rows_vary = opt.curvature_samples is not None or opt.position_rows is not None  # each rank's part of k rows
        live, metas = check_records(layers, rows_vary)
        self._local, self._local_groups, self._rebuild_local = {}, [], False
        lays = [layers[i] for i in live]
        M = self.world * lays[0].m if lays else 0
        cut = [lay for lay in lays if not per_sample_only(lay)]  # per-sample gradients P travel whole: gather
        # "auto" with the ranks' parts of the k rows: gathered whole (the ranks' own records differ in size)
        chosen = iter(choose_fsdp_modes(cut, M, self.world, self._shards, self.bandwidth, self.flop_rate, self.mode)
                      if not (rows_vary and self.mode == "auto") else ["gather"] * len(cut))
        modes = ["gather" if per_sample_only(lay) else next(chosen) for lay in lays]
        self.modes = {lay.name: md for lay, md in zip(lays, modes)}
        self.owner = {lay.name: REPLICATED for lay in lays}
        gather = [i for i, md in zip(live, modes) if md == "gather"]
        blocks = [i for i, md in zip(live, modes) if md == "gram-blocks"]
        held = {(layers[i].name, s, j): [mt[i][s][j]["G"][0][0] for mt in metas]
                for i in blocks for s, recs in enumerate(metas[self.rank][i]) for j in range(len(recs))} \
            if rows_vary else None  # each rank's part of the k rows, per record
        self._row_parts = exchange_rows([layers[i] for i in blocks], self._coords, self._shards, self.rank,
                                        self.sharing.add_bytes, held) if blocks else {}
        gather_records(layers, gather, [REPLICATED] * len(gather), opt._info.store, self.rank, self.world, set(),
                       self.sharing.add_bytes, metas if rows_vary else None)
        self.layers = lays

    def build_groups(self, opt: Host) -> list[LayerGroup]:
        """Groups of the ``gather`` layers (their Grams over the global batch) and a
        :class:`RowGroup` of the ``gram-blocks`` layers per row count (``k`` position rows
        next to norm layers' ``W·m`` samples; Grams summed over the shard group from the row
        shards', one all_reduce); per layer its records cut to this rank's rows (taken before
        the groups stack them)."""
        gather = [lay for lay in self.layers if self.modes[lay.name] == "gather"]
        blocks = [lay for lay in self.layers if self.modes[lay.name] == "gram-blocks"]
        rows = {lay.name: row_records(lay) for lay in gather}
        by_rows: dict[int, list[CoveredLayer]] = {}  # one group per row count (k position rows, W·m samples)
        for lay in blocks:  # the global batch's per-sample scale: W times the local loss's batch (a mean loss)
            parts, db = self._row_parts[lay.name]
            rows[lay.name] = layer_rows(lay, parts, self.world * lay._scale(), db=db)
            by_rows.setdefault(parts[0][1].shape[0], []).append(lay)
        self._row_parts = {}
        groups = build_groups(gather, opt.strategy, opt.jacobian_budget)[0] if gather else []
        Ks = self.sum_parts([torch.stack([rows[lay.name].gram() for lay in lays]) for lays in by_rows.values()],
                            "sum of the row shards' Grams") if by_rows else []
        S = self._shards
        for K, lays in zip(Ks, by_rows.values()):
            for lay in lays:
                self.sharing.add_bytes(lay.name, 2 * (S - 1) * K[0].numel() * K.element_size() // S)
            groups.append(RowGroup(lays, K.shape[-1], K=K))
        opt._info.store.jacobian_sites = set()
        opt.curvature.set_groups(groups)
        self._n_gather = len(groups)
        self._row_groups = [ShardRows([lay], grp.m, rows=rows[lay.name]) for grp in opt.curvature.groups
                            for lay in grp.layers]
        return groups

    def after_factorize(self, opt: Host) -> None:
        """Only the factors and this rank's rows of the records stay: the groups' stacks and
        the store's global records are dropped (a rank keeps ``I`` and its columns of ``G``)."""
        for grp in opt.curvature.groups:
            grp.release()
        store = opt._info.store
        for lay in self.layers:  # gram-blocks layers: this rank's own records
            for site in lay.spec.sites:
                store.records.pop(site, None)

    def reuse_groups(self, opt: Host) -> list[LayerGroup]:
        """None: the products run on the row records (:meth:`solved_groups`), not the groups."""
        return []

    whole_gradients = False  # the Woodbury form on every step: push-through's probe reads whole gradients
    solve = SingleProcess.solve  # over solved_groups: this rank's rows of every cached layer

    def solved_groups(self, opt: Host) -> list[LayerGroup]:
        """Every cached layer's rows on this rank (:class:`~.shard_groups.ShardRows`, the
        cached factors' order): ``J g`` from them is summed over the shard group
        (:meth:`sum_parts`, a ring all-reduce of ``M`` values per layer, counted here)."""
        S = self._shards
        for grp in self._row_groups:
            es = local(grp.layers[0].weight).element_size()
            self.sharing.add_bytes(grp.layers[0].name, 2 * (S - 1) * grp.m * es // S)
        return self._row_groups

    def sum_parts(self, ts: list[Tensor], what: str) -> list[Tensor]:
        """The partial sums ``ts`` summed over the shard group in one ``all_reduce``."""
        flat = self.sum_shards(torch.cat([t.reshape(-1) for t in ts]), what)
        return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in ts]), ts)]

    # ------------------------------------------------------------------ the shared step on local shards
    checks_loss_scale = False  # the loss-scale check reads whole weights: not on shards

    def local(self, t: Tensor) -> Tensor:
        """This rank's shard of a DTensor (a plain tensor as is)."""
        return local(t)

    def sum_shards(self, t: Tensor, what: str) -> Tensor:
        """``t`` summed in place over the shard group (the ranks holding the other rows)."""
        group = self.shard_group
        collective(what, lambda: dist.all_reduce(t, group=group))
        return t

    def agree(self, ok: Tensor) -> Tensor:
        """The flag ANDed over all ranks (one ``all_reduce``): every rank's local gradients
        and (shaped) updates finite and factors valid."""
        return all_ok(ok)

    def wrap_state(self, p: Tensor, t: Tensor) -> Tensor:
        """``t`` as a DTensor of ``p``'s placements (what ``torch.distributed.checkpoint`` saves)."""
        return like(p, t)

    def momentum_step(self, state: dict[Any, Any], params: list[Tensor], updates: dict[Tensor, Tensor],
                      lr: float | Tensor, momentum: float, weight_decay: float, nu: Optional[Tensor],
                      ok: Optional[Tensor]) -> Optional[bool]:
        return shard_momentum_step(self, state, params, updates, lr, momentum, weight_decay, nu, ok)

    def finish(self, opt: Host, result: StepResult) -> StepResult:
        """The rows as computed (nothing is shared: each rank applies its own rows); the
        flag is formed by the shared step (:meth:`agree`)."""
        return result

    def timings(self, begin_seconds: float) -> dict[str, float]:
        return {"gather": begin_seconds}

