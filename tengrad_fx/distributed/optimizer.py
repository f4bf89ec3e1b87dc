"""``DistributedTENGraD``: TENGraD with the Fisher blocks of the global batch, on
``torch.distributed`` (NCCL on GPUs, gloo on CPUs), layers solved on different ranks.

Setup (one process per rank, e.g. under ``torchrun``)::

    dist.init_process_group("nccl")                  # or "gloo" on CPUs
    net = tengrad_fx.prepare(model)                   # prepare first ...
    ddp = DDP(net)                                    # ... then DDP (averages the gradients)
    opt = DistributedTENGraD(ddp, lr=..., damping=...)
    # the usual loop on this rank's shard (equal local batch size m on every rank)

With ``W`` ranks the curvature batch is the global one, ``M = W·m``: every layer's
update equals single-process TENGraD's on the concatenation of the ranks' batches (rank
order), up to rounding. ``prepare(DDP(model))`` works too (``torch.fx`` cannot trace
DDP's forward, so ``prepare`` falls back to module surgery inside the wrapper; its report
says so); pass that wrapper to the optimizer and call it for the forward.

Per curvature step (``mode="gather"``; the default ``mode="auto"`` picks gather or
gram-blocks per layer, below):

1. every rank sends the shapes of its records (a small host exchange) — all ranks must
   have captured the same layers with the same local batch size (else ``ValueError``);
2. layers are assigned to owners by solve cost (:mod:`.plan`);
3. each owner receives the other ranks' records of its layers (``I`` and ``G``, or the
   per-sample gradients ``P`` that a kind always records), one bucketed ``gather`` per
   ``(owner, dtype)``, all in flight together; ``G``/``P`` are rescaled by ``m/M`` so
   they are the global batch's (``loss_reduction="mean"``; :mod:`.records`);
4. the owner builds the ``M × M`` Grams, factorizes and keeps the factors (TENGraD's own
   code, over its layers only), then computes its layers' ``u``;
5. each owner broadcasts its layers' ``u`` (one bucketed ``broadcast`` per
   ``(owner, dtype)``); all ranks then apply the same momentum update.

A reuse step (``curvature_every = T > 1``) runs only 4's solve with the cached factors
and 5: only preconditioned gradients move.

``mode="gram-blocks"``: steps 1–3 as above and the owner forms the ``M × M`` Gram from
the blocks ``K_ab = J_a J_bᵀ`` (for Linear ``(I_a I_bᵀ + 1) ⊙ (G_a G_bᵀ)``, convolutions
with their positions; never from per-sample gradients) and keeps only the factor; every
rank keeps its own records. Each step is then data-parallel (:mod:`.gram_blocks`): each
rank computes ``J_a g`` on its rows, one ``all_gather`` of these ``m``-vectors, the owner
solves ``c`` and broadcasts it (``M`` values), each rank computes ``J_aᵀ c_a``, one
``all_reduce`` of these partial sums, and every rank forms ``u = (g − Jᵀc)/α``.
``mode="auto"``: per layer, ``gather`` or ``gram-blocks`` by the cost model
:func:`.plan.choose_modes` (the busiest rank's per-step time: bytes at ``bandwidth``,
flops at ``flop_rate``);
``layer_plan()`` reports each layer's mode, placement and owner.

Overlap (async handles; the arithmetic is the same as without, so results are bit for
bit those of the sequential order, ``_overlap = False``; tested): the records of all layers travel together (one
bucket per ``(owner, dtype)``, all in flight); on every step the all-gather of the
gram-blocks layers' ``J_a g`` is in flight while the rank solves its gather layers, and
the owners' ``u`` broadcasts are in flight while it finishes the gram-blocks layers
(``c``, ``J_aᵀ c_a``, their all-reduce). Not overlapped: the records' arrival with the
Gram (the Gram of a layer needs all ``M`` rows; computing ``K_aa`` early would change the
summation and the bits), and the momentum update with the ``u`` broadcasts (the KL clip
needs ``Σ u·g`` over every layer before any parameter moves, and the update is one fused
pass over all parameters).

Placement, per layer (``placement``): ``"owner"`` as above; ``"replicate"``: every rank
all-gathers the layer's records and solves it, so its ``u`` (or, for ``gram-blocks``,
its ``c``) is never sent (more compute, no broadcast per step); ``"auto"`` (default):
replicate exactly the layers whose ``u`` (``c``) takes longer to receive than to compute
on every rank, by the cost model :func:`.plan.choose_placement`.

``mode="local"`` (the per-rank local Fisher, for world sizes where the global ``M × M``
Gram is too big, docs/distributed.md): no records move; each rank preconditions the
averaged gradient with its own ``m × m`` Fisher blocks, ``u_r = (F_r + αI)⁻¹ g``, and
the ranks' ``u_r`` are averaged by one ``all_reduce`` per step. It is not the global
Fisher's update (docs/distributed.md gives the error on a small model).

The backward never materializes per-sample gradients of Linear/Conv/norm layers here
(every rank records ``I`` and ``G``, so the records agree across ranks); the owner may
still form ``P`` from them for its Gram where TENGraD's cost model says so.

Reliability: the step's finite flag (gradients, factors) is ANDed over all ranks by one
``all_reduce``, so a non-finite value on any rank skips the step on every rank; a
skipped curvature step makes the next step take curvature again (decided from that
all-reduced flag, so every rank agrees). A failed collective (a rank that raised or
died, a timeout) raises :class:`~.comm.DistributedStepError`. The MC Fisher samples
labels with a per-rank generator seeded from ``seed`` and the rank
(:func:`mc_seed`); ``opt.last_mc_targets`` holds this rank's last sample.
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from ..capture.info import get_info
from ..capture.prepare import capturing
from ..curvature.layer import CoveredLayer
from ..optim.step.mc import check_mask, mc_capture, sample_targets
from ..optim.step.state_check import META
from ..optim.step.param_groups import Damping, grouped_layers, layer_dampings
from ..optim.tengrad.tengrad import TENGraD
from ..optim.tengrad.group_build import build_groups
from ..optim.tengrad.group_cost import reuse_cost
from ..optim.tengrad.tengrad_groups import precondition_groups, tf32_matmuls
from ..optim.step.update import finite_flag
from .comm import Bucket, all_ok
from .gram_blocks import GramBlocksStep
from .share import UpdateSharing
from .plan import assign_owners, choose_modes, choose_placement, solve_cost
from .records import REPLICATED, check_records, gather_records, record_bytes, sends_per_sample, to_per_sample

__all__ = ["DistributedTENGraD", "mc_seed"]

def mc_seed(seed: int, rank: int) -> int:
    """The MC-sampling seed of ``rank`` derived from the global ``seed``."""
    return (int(seed) * 1_000_003 + 7919 * (int(rank) + 1)) % (2 ** 63)


def _prepared(model: torch.nn.Module) -> bool:
    try:
        get_info(model)
    except ValueError:
        return False
    return True


class DistributedTENGraD(UpdateSharing, TENGraD):
    """TENGraD on the global batch of a ``torch.distributed`` job (module docstring).

    Args:
        model: ``DDP(prepare(model))`` or ``prepare(DDP(model))`` (or the prepared model
            itself, when the gradients are averaged over the ranks some other way).
        mode: global-batch Fisher with ``"gather"`` (records gathered where a layer is
            solved, ``u`` broadcast), ``"gram-blocks"`` (Gram from the ranks' blocks, the
            per-step products data-parallel) or ``"auto"`` (per layer by
            :func:`.plan.choose_modes`); or ``"local"`` (per-rank Fisher blocks, updates averaged).
        placement: ``"auto"``, ``"owner"`` or ``"replicate"`` (module docstring).
        bandwidth, flop_rate: the cost models' bytes/s and flop/s per rank (``"auto"``).
        seed: global seed of the MC Fisher's label sampling (per-rank seeds :func:`mc_seed`).
        **kwargs: TENGraD's options (``compile`` and ``cuda_graph`` are off here: the
            step's collectives are not captured in CUDA graphs; ``fisher="gauss-newton"``
            is not supported).
    """

    def __init__(self, model: torch.nn.Module, lr: float, damping: float, *,
                 mode: Literal["gather", "gram-blocks", "auto", "local"] = "auto",
                 placement: Literal["auto", "owner", "replicate"] = "auto", seed: int = 0,
                 bandwidth: float = 50e9, flop_rate: float = 50e12, **kwargs: Any):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedTENGraD: call torch.distributed.init_process_group(...) first "
                               "(e.g. run under torchrun)")
        if mode not in ("gather", "gram-blocks", "auto", "local"):
            raise ValueError("DistributedTENGraD: mode must be 'gather', 'gram-blocks', 'auto' or 'local', "
                             f"got {mode!r}")
        if placement not in ("auto", "owner", "replicate"):
            raise ValueError(f"DistributedTENGraD: placement must be 'auto', 'owner' or 'replicate', got {placement!r}")
        for opt in ("compile", "cuda_graph"):
            if kwargs.get(opt):
                raise ValueError(f"DistributedTENGraD: {opt}=True is not supported; leave it False")
        kwargs["cuda_graph"] = False  # TENGraD's CUDA default would capture the step's collectives
        if kwargs.get("curvature_samples") is not None:
            raise ValueError("DistributedTENGraD: curvature_samples is not supported (the global batch's records "
                             "are gathered whole); leave it None, or use TENGraD on one process")
        if kwargs.get("fisher") == "gauss-newton":
            raise ValueError("DistributedTENGraD: fisher='gauss-newton' is not supported; use 'empirical' or 'mc'")
        module = model
        if isinstance(model, DistributedDataParallel) and not _prepared(model):
            module = model.module  # DDP(prepare(model)); prepare(DDP(model)) keeps its info on the wrapper
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.mode = mode
        self.placement = placement
        self.bandwidth, self.flop_rate = float(bandwidth), float(flop_rate)
        self.seed = int(seed)
        super().__init__(module, lr, damping, **kwargs)
        if self._info.loss_reduction != "mean":
            raise ValueError("DistributedTENGraD: prepare(..., loss_reduction='mean') is required (DDP averages "
                             "the gradients over the ranks, i.e. the global loss is the mean over the global batch)")
        self._all_layers: list[CoveredLayer] = grouped_layers(module, self.param_groups)
        self._layers = []  # this rank's layers: set at each curvature step
        self._owner: dict[str, int] = {}  # layer name -> owning rank, REPLICATED (last curvature step)
        self._mode: dict[str, str] = {}  # layer name -> "gather" / "gram-blocks" (last curvature step)
        self._local: dict[int, list[Any]] = {}  # site -> this rank's own records of gram-blocks layers
        self._local_groups: list[Any] = []  # LayerGroups over them (every rank)
        self._rebuild_local = False
        self._n_gather = 0  # self._curv[:_n_gather]: groups of gather layers; the rest gram-blocks
        self._sharing: Optional[tuple[list[Tensor], list[Bucket], list[Any]]] = None  # u broadcasts in flight
        self._overlap = True  # False: the same collectives one after the other (tests: identical bits)
        self._fresh = True  # no curvature yet (on any rank)
        self._generators: dict[str, torch.Generator] = {}
        self.last_mc_targets: Optional[Tensor] = None
        self.comm_bytes: dict[str, int] = {}  # bytes this rank sent on the last step, per layer

    # ------------------------------------------------------------------ schedule (rank-independent)
    def _needs_capture(self, step: int) -> bool:
        return self._fresh or self._recapture or step - self._curv_sched >= self.curvature_every

    def _on_seen_skip(self) -> None:
        """The host saw a skip through the non-blocking mirror: when that happens differs
        between ranks, so it does not touch the schedule here (see :meth:`_after_flags`)."""

    def _after_flags(self, stats_step: bool, ok: Tensor) -> None:
        if stats_step and not bool(ok):  # one host read, curvature steps only; ok is all-reduced
            self._recapture = True

    def _initial_jacobian_sites(self, m: int = 128) -> None:
        self._info.store.jacobian_sites = set()

    # ------------------------------------------------------------------ MC
    def _generator(self, device: torch.device, purpose: str = "mc") -> torch.Generator:
        """This rank's MC-label generator, or (``purpose="probe"``) the push-through probe's
        of the ``gram-blocks`` layers, seeded alike on every rank."""
        key = f"{purpose}:{device}"
        if key not in self._generators:
            seed = mc_seed(self.seed, self.rank) if purpose == "mc" else 0
            self._generators[key] = torch.Generator(device=device).manual_seed(seed)
        return self._generators[key]

    def _mc_backward(self, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> None:
        """As :meth:`TENGraD.mc_capture`, labels sampled with this rank's generator
        (kept in ``last_mc_targets``) unless ``targets`` are given."""
        mask = check_mask(outputs, mask, self.mc_loss)
        if targets is None:
            targets = sample_targets(outputs, self.mc_loss, self._generator(outputs.device), mask)
        self.last_mc_targets = targets
        weights = [layer.weight for layer in self._all_layers if layer.weight.requires_grad]
        mc_capture(self._info.store, outputs, self.mc_loss, weights, targets, self._loss_scale(), mask)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """As TENGraD's, without the curvature records (they are per owner), saved as a
        TENGraD state: it resumes on any world size, or in one process by ``TENGraD``;
        the resumed run takes curvature at its first step."""
        sd = super().state_dict()
        sd.pop("curvature", None)
        sd[META] = {**sd[META], "optimizer": "TENGraD"}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ``DistributedTENGraD`` (any world size) or ``TENGraD``
        (its curvature records, if any, are dropped: the next step takes curvature)."""
        sd = {k: v for k, v in state_dict.items() if k != "curvature"}
        if isinstance(sd.get(META), dict) and sd[META].get("optimizer") == "TENGraD":
            sd[META] = {**sd[META], "optimizer": type(self).__name__}
        self._forget_plan()
        super().load_state_dict(sd)
        capturing(self.model, True)

    def _forget_plan(self) -> None:
        """No curvature, owners or modes: the next step takes curvature on every rank."""
        self._fresh = True
        self._layers, self._owner, self._mode, self._local, self._local_groups = [], {}, {}, {}, []

    def _groups_changed(self) -> None:
        """Parameters were added (on every rank alike): the layers are re-read and the
        next step takes curvature and plans again."""
        super()._groups_changed()
        self._all_layers = self._layers
        self._forget_plan()

    # ------------------------------------------------------------------ step
    def _natural_updates(self, step: int, curvature_step: bool, mc_step: bool,
                         damping: Damping) -> dict[Tensor, Tensor]:
        t0 = time.perf_counter()
        self.comm_bytes = {}
        self._sharing = None
        if curvature_step:
            if self.mode == "local":
                self._layers = [lay for lay in self._all_layers if lay.captured]
            else:
                self._exchange_records()
            self._fresh = False
        t1 = time.perf_counter()
        local = super()._natural_updates(step, curvature_step, mc_step, damping)
        t2 = time.perf_counter()
        updates = self._average_updates(local) if self.mode == "local" else self._share_updates(local)
        # every rank skips together: its gradients' finiteness (the skeleton checks them
        # again with the shared updates) and its factors, all-reduced
        ok = finite_flag([p.grad for p in self._group_params() if p.grad is not None])
        assert ok is not None
        self._step_flag = all_ok(ok if self._chol_ok is None else ok & self._chol_ok)
        self.timings = {**self.timings, "gather": t1 - t0, "share": time.perf_counter() - t2}
        return updates

    def _exchange_records(self) -> None:
        """Steps 1–3 of the module docstring: metadata, owners, modes, gathered records."""
        layers = self._all_layers
        live = check_records(layers)
        self._local, self._local_groups, self._rebuild_local = {}, [], True
        self._owner, self._mode = {}, {}
        if not live:
            self._layers = []
            return
        M = self.world * layers[live[0]].m
        owners = assign_owners([solve_cost(M, layers[i].dims()) for i in live], self.world)
        modes = [self.mode] * len(live)
        if self.mode == "auto":
            ns = [sum(p.numel() for p in (layers[i].weight, layers[i].bias) if p is not None) for i in live]
            recs = [record_bytes(layers[i], M, self.strategy) for i in live]
            modes = choose_modes(M, ns, [layers[i].dims() for i in live], owners, self.world, self.bandwidth,  # type: ignore[assignment]
                                 self.flop_rate, recs, self.curvature_every)
        keep = set()
        store = self._info.store
        for q, i in enumerate(live):
            lay = layers[i]
            mode = self._mode[lay.name] = modes[q]
            if mode == "gather" and sends_per_sample(lay, M, self.strategy):
                to_per_sample(lay)  # P is smaller than I, G and the owner would materialize anyway
            if self._placement(lay, M, mode) == "replicate":
                owners[q] = REPLICATED
            self._owner[lay.name] = owners[q]
            if mode == "gram-blocks":
                keep.add(i)
                self._local.update({site: list(store.records.get(site, [])) for site in lay.spec.sites})
        mine = gather_records(layers, live, owners, store, self.rank, self.world, keep, self._add_bytes)
        self._layers = [layers[i] for i in mine]

    def _refresh(self, damping: Damping) -> None:
        """As TENGraD's, over the layers solved here, with the ``gram-blocks`` layers in
        groups of their own (after the gather layers'); then every rank's store gets its
        own rows of the ``gram-blocks`` layers back (the global records are not kept)."""
        t_start = time.perf_counter()
        mode = self._mode
        gather, _ = build_groups([lay for lay in self._layers if mode.get(lay.name) != "gram-blocks"],
                                 self.strategy, self.jacobian_budget)
        blocks, _ = build_groups([lay for lay in self._layers if mode.get(lay.name) == "gram-blocks"],
                                 self.strategy, self.jacobian_budget)
        self._info.store.jacobian_sites = set()  # backward records stay I, G on every rank
        with tf32_matmuls(self.gram_tf32):
            self._K = [grp.gram() for grp in gather + blocks]
        self._gram_seconds = time.perf_counter() - t_start
        self._curv, self._n_gather = gather + blocks, len(gather)
        self._factorize(damping)
        for grp in blocks:  # only the factor stays
            grp.release()
        self._info.store.records.update({site: list(recs) for site, recs in self._local.items()})
        if self._rebuild_local:  # every rank: its own rows of every gram-blocks layer, grouped
            lays = [lay for lay in self._all_layers if self._mode.get(lay.name) == "gram-blocks"]
            # unpacked: the groups' J_a g and Jᵀc partial sums travel (no zero columns sent)
            self._local_groups = build_groups(lays, self.strategy, self.jacobian_budget, packed=False)[0] \
                if lays else []
            self._rebuild_local = False

    def _precondition(self, push_through: bool, damping: Damping) -> dict[Tensor, Tensor]:
        """``u`` of the gather layers solved here (TENGraD's) and of every ``gram-blocks``
        layer (data-parallel, :class:`.gram_blocks.GramBlocksStep`), overlapped: the
        all-gather of the ``J_a g`` runs while this rank solves its gather layers; the
        broadcasts of their ``u`` run while it finishes the gram-blocks layers."""
        use_pt = push_through and self.update_form == "auto"
        step = None

        def start_blocks() -> GramBlocksStep:  # computes J_a g, starts its all-gather
            device = self._local_groups[0].layers[0].weight.device
            return GramBlocksStep(self._local_groups, use_pt, self._generator(device, "probe"), self._add_bytes)

        if self._local_groups and self._overlap:
            step = start_blocks()
        gather = self._curv[:self._n_gather]
        out: dict[Tensor, Tensor] = {}
        alphas = self._layer_dampings(damping)  # float, or [L_total] in _curv's order
        if gather and self._chol is not None:
            L = sum(len(grp.layers) for grp in gather)
            out, _ = precondition_groups(gather, self._chol[:L], use_pt, alphas[:L] if isinstance(damping, tuple)
                                         else alphas, self._info.loss_reduction)
        if self.mode != "local" and self._overlap:
            self._start_share(out)  # the owners' u of gather layers, in flight from here
        if self._local_groups and step is None:
            step = start_blocks()
        if step is not None:
            chol = {lay.name: grp.chol[i] for grp in self._curv[self._n_gather:] if grp.chol is not None
                    for i, lay in enumerate(grp.layers)}
            alphas_of = damping if not isinstance(damping, tuple) else \
                dict(zip([lay.name for lay in self._all_layers],
                         layer_dampings(damping, self.param_groups, self._all_layers).tolist()))
            step.exchange(self._owner, chol, alphas_of)
            out.update(step.finish())
        return out

    def reuse_cost(self) -> tuple[float, float]:
        """TENGraD's, over the gather layers solved here."""
        groups = self._curv[:self._n_gather]
        return reuse_cost(groups) if groups else (0.0, 0.0)

    def layer_plan(self) -> dict[str, dict[str, Any]]:
        """Per covered layer (as of the last curvature step): ``mode`` (``"gather"`` or
        ``"gram-blocks"``; ``"local"`` in local mode), ``placement`` (``"owner"`` or
        ``"replicate"``) and ``owner`` (the solving rank, None when replicated)."""
        if self.mode == "local":
            return {lay.name: {"mode": "local", "placement": "replicate", "owner": None} for lay in self._all_layers}
        return {name: {"mode": self._mode[name], "placement": "replicate" if r == REPLICATED else "owner",
                       "owner": None if r == REPLICATED else r} for name, r in self._owner.items()}

    def _placement(self, lay: CoveredLayer, M: int, mode: str) -> str:
        if self.placement != "auto":
            return self.placement
        recs = lay.records()
        rec_bytes = sum(t.numel() * t.element_size() for r in recs for t in (r.I, r.G, r.P, r.Gsum) if t is not None)
        n = sum(p.numel() for p in (lay.weight, lay.bias) if p is not None)
        return choose_placement(M, n, rec_bytes, lay.dims(), self.world, self.curvature_every,
                                self.bandwidth, self.flop_rate, mode)
