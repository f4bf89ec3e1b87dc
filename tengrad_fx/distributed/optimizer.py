"""``DistributedTENGraD``: TENGraD with the Fisher blocks of the global batch, on
``torch.distributed`` (NCCL on GPUs, gloo on CPUs), layers solved on different ranks:
``TENGraD`` with the :class:`GlobalBatch` distribution (``TENGraD(..., distribution=GlobalBatch())``
is the same optimizer).

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

``curvature_samples=k`` / ``position_rows=k`` (``gather`` and ``gram-blocks``; ``"auto"``
gathers every layer): the rank-reduced Fisher of the global batch, single-process TENGraD's
on the concatenated batch. Before step 1 each rank keeps its part of the ``k`` rows
(:meth:`GlobalBatch.curvature_part`: the first ``k`` samples of the global batch; or ``k`` of
its ``M·S`` position rows, drawn by the single-process draw from the optimizer's row
generator, seeded with ``seed`` alike on every rank, among the global batch's scored
positions), and step 3 moves only those rows (:func:`.records.gather_records` with the ranks'
row counts): at most ``k`` rows per layer, whatever ``W``. In ``gram-blocks`` mode each rank's
``J_a g`` has its own rows (zero-padded to the most of any rank in the all-gather).

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

Overlap (async handles, the same arithmetic, so the bits of the sequential order,
``distribution.overlap = False``): the records of all layers travel together; the
all-gather of the ``J_a g`` and the owners' ``u`` broadcasts are in flight while the rank
solves (docs/distributed.md, "Overlap").

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
died, a timeout) raises :class:`~.comm.DistributedStepError`. The MC Fisher draws
the global batch's labels from the optimizer's generator, seeded with ``seed`` in the same
state on every rank, and each rank keeps its slice
(:func:`~tengrad_fx.optim.step.mc.sample_targets`): the labels one process draws for the
concatenated batch, whatever ``W``; ``opt.last_mc_targets`` holds this rank's last sample.

CUDA graphs (``cuda_graph``, default on for NCCL and CUDA parameters): the reuse steps of
every mode, collectives included, are captured and replayed on every rank alike
(:mod:`tengrad_fx.optim.tengrad.cuda_graphs`; docs/distributed.md); on gloo they run eagerly.
"""
from __future__ import annotations

from typing import Any, ClassVar, Optional

import torch
from torch import Tensor

from ..optim.tengrad.tengrad import TENGraD
from .fsdp_rows import fully_sharded
from .global_batch import GlobalBatch, Mode, Placement

__all__ = ["DistributedTENGraD", "GlobalBatch"]


class DistributedTENGraD(TENGraD):
    """TENGraD on the global batch of a ``torch.distributed`` job (module docstring):
    ``TENGraD(model, lr, damping, distribution=GlobalBatch(mode, placement, seed, bandwidth,
    flop_rate), **kwargs)``.

    Args:
        model: ``DDP(prepare(model))`` or ``prepare(DDP(model))`` (or the prepared model
            itself, when the gradients are averaged over the ranks some other way); a model
            sharded by FSDP2 makes this an :class:`~.fsdp_optimizer.FSDPTENGraD`.
        mode: global-batch Fisher with ``"gather"`` (records gathered where a layer is
            solved, ``u`` broadcast), ``"gram-blocks"`` (Gram from the ranks' blocks, the
            per-step products data-parallel) or ``"auto"`` (per layer by
            :func:`.plan.choose_modes`); or ``"local"`` (per-rank Fisher blocks, updates averaged).
        placement: ``"auto"``, ``"owner"`` or ``"replicate"`` (module docstring).
        bandwidth, flop_rate: the cost models' bytes/s and flop/s per rank (``"auto"``).
        seed: the seed of the optimizer's generator on every rank (``opt.seed_mc(seed)``): the
            MC Fisher's labels of the global batch and the position rows' draw.
        **kwargs: TENGraD's options (``cuda_graph``: reuse steps replayed as CUDA graphs,
            collectives included, default on for NCCL and CUDA parameters, module docstring;
            ``metric`` and ``relative_damping`` as on one process, the metric's records scaled
            before they move and each ``gram-blocks`` layer's relative-damping scale broadcast
            by its owner (:mod:`.dampings`); ``fisher="gauss-newton"`` as on one process, each
            rank's ``m·k`` stacked rows the global batch's ``W·m·k`` (:mod:`.records`);
            ``compile=True`` is accepted and fuses nothing: every step runs the distributed
            path, ``GlobalBatch.fuses``; ``curvature_samples`` and ``position_rows`` the rows
            chosen over the global batch, the position rows from the generator ``seed_mc``
            seeds, seeded with ``seed`` on every rank (module docstring), refused in
            ``"local"`` mode only, which forms no global Fisher: ``ValueError``).
    """

    distribution: GlobalBatch

    sharded_class: ClassVar[Optional[type]] = None  # FSDP2 models' (set by .fsdp_optimizer: FSDPTENGraD)

    def __new__(cls, model: torch.nn.Module, *args: Any, **kwargs: Any) -> "DistributedTENGraD":
        if cls is DistributedTENGraD and cls.sharded_class is not None and fully_sharded(model):
            return super().__new__(cls.sharded_class)
        return super().__new__(cls)

    def __init__(self, model: torch.nn.Module, lr: float, damping: float, *, mode: Mode = "auto",
                 placement: Placement = "auto", seed: int = 0, bandwidth: float = 50e9, flop_rate: float = 50e12,
                 **kwargs: Any):
        if "distribution" in kwargs:
            raise ValueError("DistributedTENGraD: distribution= is its own (GlobalBatch); pass mode/placement/seed, "
                             "or use TENGraD(..., distribution=...)")
        super().__init__(model, lr, damping, distribution=GlobalBatch(mode, placement, seed, bandwidth, flop_rate),
                         **kwargs)

    def layer_plan(self) -> dict[str, dict[str, Any]]:
        """Per covered layer (as of the last curvature step): ``mode`` (``"gather"`` or
        ``"gram-blocks"``; ``"local"`` in local mode), ``placement`` (``"owner"`` or
        ``"replicate"``) and ``owner`` (the solving rank, None when replicated)."""
        return self.distribution.layer_plan(self)

    @property
    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank sent on the last step, per layer name."""
        return self.distribution.sharing.comm_bytes

    @property
    def last_mc_targets(self) -> Optional[Tensor]:
        """This rank's last MC sample (``fisher="mc"``), or the targets given to ``mc_capture``."""
        return self.distribution.last_mc_targets

    @last_mc_targets.setter
    def last_mc_targets(self, value: Optional[Tensor]) -> None:
        self.distribution.last_mc_targets = value

    @property
    def mode(self) -> str:
        return self.distribution.mode

    @property
    def placement(self) -> str:
        return self.distribution.placement

    @property
    def world(self) -> int:
        return self.distribution.world

    @property
    def rank(self) -> int:
        return self.distribution.rank

    @property
    def seed(self) -> int:
        return self.distribution.seed

