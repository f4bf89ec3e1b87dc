"""The :class:`GlobalBatch` distribution: the strategy :class:`~.optimizer.DistributedTENGraD`
runs TENGraD with (the records of the global batch gathered to each layer's solver, or
exchanged as Gram blocks; module docstring of :mod:`.optimizer`)."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from ..capture.info import get_info
from ..curvature.layer import CoveredLayer
from ..optim.step.param_groups import Damping
from ..optim.step.result import StepResult
from ..optim.step.update import finite_flag
from ..optim.tengrad.cache import layer_alphas
from ..optim.tengrad.distribution import Host, SingleProcess
from ..optim.tengrad.group_build import build_groups
from ..optim.tengrad.layer_groups import LayerGroup, precondition
from .comm import all_ok, nccl_backend
from .dampings import share_scales
from .gram_blocks import RowBlocks, rows_by_group
from .plan import assign_owners, choose_modes, choose_placement, solve_cost
from .records import (REPLICATED, check_records, gather_records, global_scored, record_bytes, sends_per_sample,
                      to_per_sample)
from .share import UpdateSharing

__all__ = ["GlobalBatch", "Mode", "Placement"]

Mode = Literal["gather", "gram-blocks", "auto", "local"]
Placement = Literal["auto", "owner", "replicate"]


def _prepared(model: torch.nn.Module) -> bool:
    try:
        get_info(model)
    except ValueError:
        return False
    return True


class GlobalBatch(SingleProcess):
    """TENGraD's distribution over a ``torch.distributed`` job: the global batch's Fisher
    (module docstring; arguments as :class:`DistributedTENGraD`'s). Every rank decides the
    same curvature steps: TENGraD's schedule, and a skipped curvature step re-taken as the
    all-reduced flag says (:attr:`agreed_skips`)."""

    saves_records = False  # records are per owner: a resumed run takes curvature first
    agreed_skips = True
    fuses = False  # compile: the fused update is one process's solve; the steps here run the modular path
    nccl = True  # the process group's backend is NCCL (read at construction): its collectives can be captured

    def __init__(self, mode: Mode = "auto", placement: Placement = "auto", seed: int = 0,
                 bandwidth: float = 50e9, flop_rate: float = 50e12):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedTENGraD: call torch.distributed.init_process_group(...) first "
                               "(e.g. run under torchrun)")
        if mode not in ("gather", "gram-blocks", "auto", "local"):
            raise ValueError("DistributedTENGraD: mode must be 'gather', 'gram-blocks', 'auto' or 'local', "
                             f"got {mode!r}")
        if placement not in ("auto", "owner", "replicate"):
            raise ValueError(f"DistributedTENGraD: placement must be 'auto', 'owner' or 'replicate', got {placement!r}")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.nccl = nccl_backend()  # a reuse step's broadcasts, all_gathers, all_reduces: NCCL captures them
        self.mode, self.placement, self.seed = mode, placement, int(seed)
        self.bandwidth, self.flop_rate = float(bandwidth), float(flop_rate)
        self.overlap = True  # False: the same collectives one after the other (tests: identical bits)
        self.sharing = UpdateSharing(self.rank, self.world)
        self.last_mc_targets: Optional[Tensor] = None
        self._generators: dict[str, torch.Generator] = {}  # "probe:device" -> generator
        self._generator_steps: dict[str, int] = {}  # "probe:device" -> the step it was seeded for
        self._seconds = (0.0, 0.0)  # (gather, share) of the last step
        self.forget()

    def forget(self) -> None:
        """No curvature, owners or modes: the next step takes curvature on every rank."""
        self.fresh = True  # no curvature yet (on any rank)
        self.layers: list[CoveredLayer] = []  # the layers solved here (last curvature step)
        self.owner: dict[str, int] = {}  # layer name -> owning rank, REPLICATED (last curvature step)
        self.modes: dict[str, str] = {}  # layer name -> "gather" / "gram-blocks" (last curvature step)
        self._local: dict[int, list[Any]] = {}  # site -> this rank's own records of gram-blocks layers
        self._local_groups: list[Any] = []  # LayerGroups over them (every rank)
        self._rebuild_local = False
        self._n_gather = 0  # curvature.groups[:_n_gather]: groups of gather layers; the rest gram-blocks
        self._scales: dict[str, Tensor] = {}  # gram-blocks layer name -> its damping scale (relative_damping)
        self._taking = False  # this step forms new Grams (begin): the scales are exchanged then only
        self._group_rows: Optional[list[list[int]]] = None  # per local group, each rank's rows (rows_vary)
        self._kept: dict[int, list[Any]] = {}  # site -> this rank's own records (Metric.root_every: moved again)

    # ------------------------------------------------------------------ construction
    LABEL = "DistributedTENGraD"

    GRAPH_COLLECTIVES = ("the process group's backend is not NCCL, whose collectives on CUDA tensors alone can be "
                         "captured in a CUDA graph; pass cuda_graph=False or leave it None")

    def lacks(self) -> dict[str, str]:
        """Collectives a CUDA graph captures unless the backend is NCCL; under ``mode='local'``
        also the global batch's Fisher to choose rows of."""
        out: dict[str, str] = {}
        if not self.nccl:
            out["graph_collectives"] = self.GRAPH_COLLECTIVES
        if self.mode == "local":
            out["global_rows"] = ("mode='local' does not form the global batch's Fisher (each rank preconditions "
                                  "with its own); pass mode='gather', 'gram-blocks' or 'auto', or leave it None")
        return out

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, DistributedDataParallel) and not _prepared(model):
            return model.module  # DDP(prepare(model)); prepare(DDP(model)) keeps its info on the wrapper
        return model

    def bind(self, opt: Host) -> None:
        if opt._info.loss_reduction != "mean":
            raise ValueError("DistributedTENGraD: prepare(..., loss_reduction='mean') is required (DDP averages "
                             "the gradients over the ranks, i.e. the global loss is the mean over the global batch)")
        lacks = self.lacks()
        if opt.cuda_graph and "graph_collectives" in lacks and any(p.is_cuda for p in opt._group_params()):
            raise ValueError(f"DistributedTENGraD: cuda_graph=True with CUDA parameters needs the NCCL backend "
                             f"(the process group's is {dist.get_backend()!r}): {lacks['graph_collectives']}")

        if opt._mc_rng.state() is None:
            opt._mc_rng.seed(self.seed)  # MC labels and position rows: the same generator state on every rank

    def reset(self, opt: Host) -> None:
        self.forget()

    def curvature_part(self, opt: Host) -> tuple[int, int, Optional[Tensor]]:
        """This rank's part of the global batch ``(rank, W)``, and (``position_rows``, where the
        loss scores only some positions) the global batch's scored positions ``[M, S]``: the
        ranks' masks, exchanged on the host (small)."""
        return (*self.batch_part(), global_scored(opt._info.store) if opt.position_rows is not None else None)

    def batch_part(self) -> tuple[int, int]:
        """``(rank, W)``: the global batch is the ranks' equal local batches in rank order."""
        return self.rank, self.world

    def initial_sites(self, opt: Host) -> set[int]:
        return set()  # every rank records I and G: the records agree across ranks

    def has_curvature(self, opt: Host) -> bool:
        return not self.fresh

    has_factors = has_curvature  # on every rank alike (a rank may hold no factor): the same graph steps

    # ------------------------------------------------------------------ MC
    def _generator(self, device: torch.device, step: int) -> torch.Generator:
        """The push-through probe's generator of the ``gram-blocks`` layers at step ``step``
        (the optimizer's step count), seeded alike on every rank from the step alone."""
        key = f"probe:{device}"
        if self._generator_steps.get(key) != step:
            self._generators[key] = torch.Generator(device=device).manual_seed(step)
            self._generator_steps[key] = step
        return self._generators[key]

    def mc_sample(self, opt: Host, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        """This rank's slice of the global batch's labels (:meth:`SingleProcess.mc_sample`,
        the optimizer's generator in the same state on every rank: seeded with ``seed`` at
        :meth:`bind`, saved in ``state_dict``), kept in :attr:`last_mc_targets`."""
        self.last_mc_targets = super().mc_sample(opt, outputs, targets, mask)
        return self.last_mc_targets

    # ------------------------------------------------------------------ step
    def restore_rows(self, opt: Host) -> None:
        """This rank's own rows of the last curvature step back in the store (kept by
        :meth:`begin` where the metric recomputes ``S`` between curvature steps): the metric
        rescales them and :meth:`begin` moves them as on a curvature step."""
        opt._info.store.records.update({site: list(recs) for site, recs in self._kept.items()})

    def begin(self, opt: Host, new_rows: bool) -> None:
        t0 = time.perf_counter()
        self.sharing.reset(opt._layers)
        self._taking = new_rows
        if new_rows:
            if getattr(opt.metric, "root_every", None) is not None:  # Metric.root_every: rows moved again
                store = opt._info.store
                self._kept = {site: list(store.records.get(site, [])) for lay in opt._layers if lay.captured
                              for site in lay.spec.sites}
            # a captured reuse step reads this step's records and factors: its graphs are replaced
            opt.curvature.replaced()
            if self.mode == "local":
                self.layers = [lay for lay in opt._layers if lay.captured]
            else:
                self._exchange_records(opt)
            self.fresh = False
        self._seconds = (time.perf_counter() - t0, 0.0)

    def solve_layers(self, opt: Host) -> list[CoveredLayer]:
        return self.layers

    def _exchange_records(self, opt: Host) -> None:
        """Steps 1–3 of the module docstring: metadata, owners, modes, gathered records."""
        layers = opt._layers
        rows_vary = opt.curvature_samples is not None or opt.position_rows is not None  # each rank's part of k rows
        live, metas = check_records(layers, rows_vary)
        self._local, self._local_groups, self._rebuild_local = {}, [], True
        self.owner, self.modes = {}, {}
        if not live:
            self.layers = []
            return
        M = self.world * layers[live[0]].m
        if rows_vary:  # the rows of the first layer's first record, over the ranks
            M = sum(next(d for recs in mt[live[0]] for d in recs)["in_shape"][0] for mt in metas)
        owners = assign_owners([solve_cost(M, layers[i].dims()) for i in live], self.world)
        modes: list[str] = [self.mode] * len(live) if not (rows_vary and self.mode == "auto") \
            else ["gather"] * len(live)
        if self.mode == "auto" and not rows_vary:
            ns = [sum(p.numel() for p in (layers[i].weight, layers[i].bias) if p is not None) for i in live]
            recs = [record_bytes(layers[i], M, opt.strategy) for i in live]
            modes = choose_modes(M, ns, [layers[i].dims() for i in live], owners, self.world, self.bandwidth,
                                 self.flop_rate, recs, opt.curvature_every)
        keep = set()
        store = opt._info.store
        for q, i in enumerate(live):
            lay = layers[i]
            mode = self.modes[lay.name] = modes[q]
            if mode == "gather" and not rows_vary and sends_per_sample(lay, M, opt.strategy):
                to_per_sample(lay)  # P is smaller than I, G and the owner would materialize anyway
            if self._placement(lay, M, mode, opt.curvature_every, rows_vary) == "replicate":
                owners[q] = REPLICATED
            self.owner[lay.name] = owners[q]
            if mode == "gram-blocks":
                keep.add(i)
                self._local.update({site: list(store.records.get(site, [])) for site in lay.spec.sites})
        mine = gather_records(layers, live, owners, store, self.rank, self.world, keep, self.sharing.add_bytes,
                              metas if rows_vary else None)
        self.layers = [layers[i] for i in mine]

    def build_groups(self, opt: Host) -> list[LayerGroup]:
        """The layers solved here, the ``gram-blocks`` layers in groups of their own (after the
        gather layers'); the backward keeps recording ``I, G`` on every rank."""
        mode = self.modes
        gather, _ = build_groups([lay for lay in self.layers if mode.get(lay.name) != "gram-blocks"],
                                 opt.strategy, opt.jacobian_budget)
        blocks, _ = build_groups([lay for lay in self.layers if mode.get(lay.name) == "gram-blocks"],
                                 opt.strategy, opt.jacobian_budget)
        opt._info.store.jacobian_sites = set()
        opt.curvature.set_groups(gather + blocks)
        self._n_gather = len(gather)
        return gather + blocks

    def after_factorize(self, opt: Host) -> None:
        """Only the ``gram-blocks`` layers' factors stay; every rank's store gets its own rows
        of them back (the global records are not kept), grouped for the per-step products."""
        for grp in opt.curvature.groups[self._n_gather:]:
            grp.release()
        opt._info.store.records.update({site: list(recs) for site, recs in self._local.items()})
        if self._rebuild_local:
            lays = [lay for lay in opt._layers if self.modes.get(lay.name) == "gram-blocks"]
            # unpacked: the groups' J_a g and Jᵀc partial sums travel (no zero columns sent)
            self._local_groups = build_groups(lays, opt.strategy, opt.jacobian_budget, packed=False)[0] \
                if lays else []
            self._rebuild_local = False
            rows_vary = opt.curvature_samples is not None or opt.position_rows is not None
            self._group_rows = rows_by_group(self._local_groups) if self._local_groups and rows_vary else None
            if self._local_groups and rows_vary and self._group_rows is None:  # one group per layer, in layer order
                budget = opt.jacobian_budget
                self._local_groups = [grp for lay in lays
                                      for grp in build_groups([lay], opt.strategy, budget, packed=False)[0]]
                self._group_rows = rows_by_group(self._local_groups)
        device = opt._layers[0].weight.device if opt._layers else torch.device("cpu")
        if self._taking:  # a rank that holds no factor refactorizes (nothing) on reuse steps too: no collective
            self._scales = share_scales(opt.curvature, self.owner, self.modes, self.rank, device,
                                        self.sharing.add_bytes)

    def solve(self, opt: Host, push_through: bool, damping: Damping) -> StepResult:
        """``u`` of the gather layers solved here and of every ``gram-blocks`` layer (over
        this rank's rows, :class:`.gram_blocks.RowBlocks`), both by the one Woodbury apply
        (:func:`~..optim.tengrad.layer_groups.precondition`), overlapped: the all-gather of the
        ``J_a g`` runs while this rank solves its gather layers; the broadcasts of their ``u``
        run while it finishes the gram-blocks layers."""
        cache = opt.curvature
        rows = self._block_rows(opt, push_through) if self._local_groups else None
        if rows is not None and self.overlap:
            rows.start(self._local_groups, push_through)  # J_a g, its all-gather in flight from here
        gather = cache.groups[:self._n_gather]
        out: dict[Tensor, Tensor] = {}
        alphas = cache.dampings(damping, opt.param_groups)  # float, or [L_total] in the groups' order
        if gather and cache.chol is not None:
            L = sum(len(grp.layers) for grp in gather)
            out, _ = precondition(gather, cache.chol[:L], push_through, alphas[:L] if isinstance(alphas, Tensor)
                                  else alphas, opt._info.loss_reduction)
        if self.mode != "local" and self.overlap:
            self.sharing.start(opt._layers, self.owner, self.modes, out)  # the owners' u, in flight from here
        if rows is not None:
            layers = [lay for grp in self._local_groups for lay in grp.layers]
            scales = torch.stack([self._scales[lay.name] for lay in layers]) if self._scales else None
            alphas = layer_alphas(damping, opt.param_groups, layers, scales)  # the owners' scales (relative_damping)
            out.update(precondition(self._local_groups, None, push_through, alphas, opt._info.loss_reduction,
                                    rows=rows)[0])
        return StepResult(out, cache.ok)

    def _block_rows(self, opt: Host, push_through: bool) -> RowBlocks:
        """The ``gram-blocks`` layers' rows over the ranks, with this rank's factors of them."""
        device = self._local_groups[0].layers[0].weight.device
        probe = self._generator(device, opt._sched) if push_through else None  # curvature steps only
        chol = {lay.name: grp.chol[i] for grp in opt.curvature.groups[self._n_gather:] if grp.chol is not None
                for i, lay in enumerate(grp.layers)}
        return RowBlocks(self.owner, chol, probe, self.sharing.add_bytes, self._group_rows)

    def finish(self, opt: Host, result: StepResult) -> StepResult:
        """Step 5 (every rank gets every layer's ``u``, or ``local``'s mean), and the step's
        flag ANDed over the ranks: its gradients' finiteness and its factors (every rank
        skips together)."""
        t0 = time.perf_counter()
        if self.mode == "local":
            updates = self.sharing.average(opt._layers, result.updates)
        else:
            updates = self.sharing.finish(opt._layers, self.owner, self.modes, result.updates)
        ok = finite_flag([p.grad for p in opt._group_params() if p.grad is not None])
        assert ok is not None
        flag = all_ok(ok if result.ok is None else ok & result.ok)
        self._seconds = (self._seconds[0], time.perf_counter() - t0)
        return StepResult(updates, flag)

    def timings(self, begin_seconds: float) -> dict[str, float]:
        return {"gather": begin_seconds, "share": self._seconds[1]}

    def reuse_groups(self, opt: Host) -> list[LayerGroup]:
        """The gather layers solved here."""
        return opt.curvature.groups[:self._n_gather]

    def layer_plan(self, opt: Host) -> dict[str, dict[str, Any]]:
        """:meth:`DistributedTENGraD.layer_plan`."""
        if self.mode == "local":
            return {lay.name: {"mode": "local", "placement": "replicate", "owner": None} for lay in opt._layers}
        return {name: {"mode": self.modes[name], "placement": "replicate" if r == REPLICATED else "owner",
                       "owner": None if r == REPLICATED else r} for name, r in self.owner.items()}

    def _placement(self, lay: CoveredLayer, M: int, mode: str, every: int, rows_vary: bool = False) -> str:
        if self.placement != "auto" or rows_vary:  # rows_vary: each rank's own records differ in size
            return "owner" if self.placement == "auto" else self.placement
        recs = lay.records()
        rec_bytes = sum(t.numel() * t.element_size() for r in recs for t in (r.I, r.G, r.P, r.Gsum) if t is not None)
        n = sum(p.numel() for p in (lay.weight, lay.bias) if p is not None)
        return choose_placement(M, n, rec_bytes, lay.dims(), self.world, every, self.bandwidth, self.flop_rate, mode)
