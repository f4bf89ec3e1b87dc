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
  transposed one);
* ``"gram-blocks"``: every rank receives only its rows' cut of every rank's records (one
  all_to_all per dtype, :mod:`.fsdp_exchange`), forms ``J_r J_rᵀ`` and one all_reduce over
  the shard group gives ``K = Σ_r J_r J_rᵀ`` (:class:`RowGroup`).

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
(the update runs on the local shards: :class:`~.fsdp_optimizer.FSDPTENGraD`); ``graft``
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

from .. import solve
from ..curvature.layer import CoveredLayer
from ..optim.step.param_groups import Damping
from ..optim.step.result import StepResult
from ..optim.step.update import finite_flag
from ..optim.tengrad.distribution import Host
from ..optim.tengrad.group_build import build_groups
from ..optim.tengrad.layer_groups import LayerGroup
from .comm import collective
from .fsdp_exchange import choose_fsdp_modes, exchange_rows, shard_coordinates
from .fsdp_rows import Rows, check_shardable, layer_rows, local, row_records
from .global_batch import GlobalBatch, Mode
from .records import REPLICATED, check_records, gather_records

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
        self.capturable = False  # cuda_graph stays off (check)
        self.shard_group: Optional[Any] = None  # the process group of the mesh's shard dim
        self._coords: list[int] = []  # each global rank's coordinate on the shard dim
        self._shards = 1  # the shard dim's size
        self._rows: list[Rows] = []  # the cached layers' records cut to this rank's rows (group order)
        self._row_parts: dict[str, list[tuple[Tensor, Tensor]]] = {}  # gram-blocks layers: this rank's cut
        self._modules: list[FSDPModule] = []  # the model's FSDP modules (unwrap)

    def forget(self) -> None:
        super().forget()
        self._rows = []

    def check(self, options: dict[str, Any]) -> None:
        super().check(options)
        for rows in ("curvature_samples", "position_rows"):
            if options[rows] is not None:
                raise ValueError(f"DistributedTENGraD (FSDP2): {rows}={options[rows]!r} is not supported on sharded "
                                 "parameters; leave it None, or use DDP (DistributedTENGraD on a DDP model runs it)")
        if options["cuda_graph"]:
            raise ValueError("DistributedTENGraD (FSDP2): cuda_graph=True is not supported: a replayed reuse step "
                             "reads the gradients from static buffers, and FSDP2's gradients are DTensors that its "
                             "reduce-scatter allocates anew on every backward, which the graph runner's buffer copy "
                             "does not handle (DTensor has no sharding rule for aten._foreach_copy_); leave it "
                             "False or None (off under FSDP2)")
        if options["compile"]:
            raise ValueError("DistributedTENGraD (FSDP2): compile=True is not supported on sharded parameters "
                             "(not checked against single-process TENGraD there); leave it False, or use DDP "
                             "(where it is accepted and the distributed steps run unfused)")
        if options["fisher"] == "gauss-newton":
            raise ValueError("DistributedTENGraD (FSDP2): fisher='gauss-newton' is not supported on sharded "
                             "parameters (with fully_shard on each layer, its k backward passes per curvature step "
                             "do not give single-process TENGraD's update); use 'empirical' or 'mc', or DDP "
                             "(DistributedTENGraD on a DDP model runs it)")
        for opt in ("metric", "relative_damping"):
            if options[opt]:
                raise ValueError(f"DistributedTENGraD (FSDP2): {opt}={options[opt]!r} is not supported on sharded "
                                 "parameters; leave it off, or use DDP (DistributedTENGraD on a DDP model runs it)")

    def backward_inputs(self, opt: Host, weights: list[Tensor]) -> list[Tensor]:
        """The unsharded parameters the graph read (FSDP2 registers them for the forward and
        the sharded ones again after it): a backward asked for the sharded ones would skip
        every layer with no other input of the graph behind it, e.g. a first layer resharded
        after its forward, whose ``G`` would then never be recorded."""
        unsharded: dict[Tensor, Tensor] = {}
        for mod in self._modules:
            group = mod._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else []:
                if getattr(fp, "_unsharded_param", None) is not None:
                    unsharded[fp.sharded_param] = fp._unsharded_param
        return [unsharded.get(w, w) for w in weights]

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
        live, _ = check_records(layers)
        self._local, self._local_groups, self._rebuild_local = {}, [], False
        lays = [layers[i] for i in live]
        M = self.world * lays[0].m if lays else 0
        modes = choose_fsdp_modes(lays, M, self.world, self._shards, self.bandwidth, self.flop_rate, self.mode)
        self.modes = {lay.name: md for lay, md in zip(lays, modes)}
        self.owner = {lay.name: REPLICATED for lay in lays}
        gather = [i for i, md in zip(live, modes) if md == "gather"]
        blocks = [lay for lay, md in zip(lays, modes) if md == "gram-blocks"]
        self._row_parts = exchange_rows(blocks, self._coords, self._shards, self.rank, self.sharing.add_bytes) \
            if blocks else {}
        gather_records(layers, gather, [REPLICATED] * len(gather), opt._info.store, self.rank, self.world, set(),
                       self.sharing.add_bytes)
        self.layers = lays

    def build_groups(self, opt: Host) -> list[LayerGroup]:
        """Groups of the ``gather`` layers (their Grams over the global batch) and one
        :class:`RowGroup` of the ``gram-blocks`` layers (Grams summed over the shard group
        from the row shards'); per layer its records cut to this rank's rows (taken before
        the groups stack them)."""
        gather = [lay for lay in self.layers if self.modes[lay.name] == "gather"]
        blocks = [lay for lay in self.layers if self.modes[lay.name] == "gram-blocks"]
        rows = {lay.name: row_records(lay) for lay in gather}
        k = float(self.world * blocks[0].m) if blocks and opt._info.loss_reduction == "mean" else 1.0
        rows.update({lay.name: layer_rows(lay, self._row_parts[lay.name], k) for lay in blocks})
        self._row_parts = {}
        groups = build_groups(gather, opt.strategy, opt.jacobian_budget)[0] if gather else []
        if blocks:
            K = torch.stack([rows[lay.name].gram() for lay in blocks])
            self._sum_shards(K, "sum of the row shards' Grams")
            S = self._shards
            for lay in blocks:
                self.sharing.add_bytes(lay.name, 2 * (S - 1) * K[0].numel() * K.element_size() // S)
            groups.append(RowGroup(blocks, K.shape[-1], K=K))
        opt._info.store.jacobian_sites = set()
        opt.curvature.set_groups(groups)
        self._n_gather = len(groups)
        self._rows = [rows[lay.name] for lay in opt.curvature.layers()]
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
        """None: the products run on the row records (:meth:`precondition`), not the groups."""
        return []

    def precondition(self, opt: Host, push_through: bool, damping: Damping) -> StepResult:
        """This rank's rows of every cached layer's ``u`` (module docstring), keyed by the
        DTensor parameter, as local tensors; ``Σ u·g`` and ``Σ‖g‖²`` over the whole
        parameters (summed over the shard group)."""
        cache = opt.curvature
        if not cache.groups or cache.chol is None:
            return StepResult({}, cache.ok)
        layers = cache.layers()
        grads = [_local_grads(lay) for lay in layers]
        Jg = torch.stack([rows.jvp(gw, gb) for rows, (gw, gb) in zip(self._rows, grads)])  # [L, M] partial
        self._sum_shards(Jg, "sum of the row shards' J g")
        S = dist.get_world_size(self.shard_group)
        for lay in layers:  # a ring all-reduce of M values per layer
            self.sharing.add_bytes(lay.name, 2 * (S - 1) * Jg.shape[1] * Jg.element_size() // S)
        alphas = cache.dampings(damping, opt.param_groups)
        c, beta, gamma = solve.woodbury_solve(cache.chol, Jg, alphas, None, 1.0, Jg.dtype)
        out: dict[Tensor, Tensor] = {}
        ug = Jg.new_zeros(())
        gsq = Jg.new_zeros(())
        for q, (lay, rows, (gw, gb)) in enumerate(zip(layers, self._rows, grads)):
            b = beta[q] if isinstance(beta, Tensor) else beta
            JTw, JTb = rows.vjp(c[q])
            for p, g, JT in ((lay.weight, gw, JTw), (lay.bias, gb, JTb)):
                if p is None or g is None or JT is None or p.grad is None:
                    continue
                u = solve.woodbury_combine(g.reshape(-1), JT.reshape(-1), b, gamma).view(g.shape)
                out[p] = u
                ug = ug + torch.dot(u.reshape(-1), g.reshape(-1).to(u.dtype))
                gsq = gsq + torch.dot(g.reshape(-1), g.reshape(-1)).to(gsq.dtype)
        dots = torch.stack([ug, gsq])
        self._sum_shards(dots, "sum of the row shards' u·g")
        return StepResult(out, cache.ok, dots[0], dots[1])

    def _sum_shards(self, t: Tensor, what: str) -> None:
        """``t`` summed in place over the shard group (the ranks holding the other rows)."""
        group = self.shard_group
        collective(what, lambda: dist.all_reduce(t, group=group))

    def finish(self, opt: Host, result: StepResult) -> StepResult:
        """This rank's flag: the local shards of every gradient and update are finite and the
        factors valid (ANDed over all ranks after the shaping of the updates:
        :meth:`.fsdp_optimizer.FSDPTENGraD._masked_step`)."""
        grads = [local(p.grad) for p in opt._group_params() if p.grad is not None]
        ok = finite_flag([*grads, *result.updates.values()])
        assert ok is not None
        return StepResult(result.updates, ok if result.ok is None else ok & result.ok, result.update_dot,
                          result.grad_sq)

    def timings(self, begin_seconds: float) -> dict[str, float]:
        return {"gather": begin_seconds}


def _local_grads(lay: CoveredLayer) -> tuple[Tensor, Optional[Tensor]]:
    """This rank's shards of the layer's weight and bias gradients (zeros where missing)."""
    def one(p: Tensor) -> Tensor:
        return local(p.grad) if p.grad is not None else torch.zeros_like(local(p))
    return one(lay.weight), (one(lay.bias) if lay.bias is not None else None)
