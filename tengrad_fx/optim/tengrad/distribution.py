"""How TENGraD spreads a step over processes: a strategy object passed as
``TENGraD(..., distribution=...)``. :class:`SingleProcess` (the default) is one process and
the Fisher of its batch; :class:`tengrad_fx.distributed.GlobalBatch` is the global batch's
Fisher over a ``torch.distributed`` job.

TENGraD runs the schedule, the curvature cache, the fused and CUDA-graph paths, the update's
shaping (graft, orthogonalize) and the shared step itself for every strategy; a strategy
says which layers this process solves and how (``build_groups``, ``solve``), what
moves before and after (``begin``, ``finish``), and how ranks agree on skips.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Protocol

import torch
from torch import Tensor

from ...capture.info import PrepareInfo
from ...curvature.layer import CoveredLayer
from ..step.param_groups import Damping
from ..step.mc import SampleRNG, check_mask, sample_targets
from ..step.result import StepResult
from ..step.sharding import Sharding
from .cache import CurvatureCache
from .capabilities import GRAPHS, refuse
from .group_build import build_groups, previous_stacks
from .jacobian_sites import initial_jacobian_sites, uncaptured_sites
from .layer_groups import LayerGroup, precondition

__all__ = ["SingleProcess", "Host"]


class Host(Protocol):
    """What a strategy reads of its :class:`~.tengrad.TENGraD` (and nothing else)."""

    @property
    def _layers(self) -> list[CoveredLayer]: ...  # every covered layer whose weight is in a group
    @property
    def _info(self) -> PrepareInfo: ...
    @property
    def _mc_rng(self) -> SampleRNG: ...
    @property
    def _sched(self) -> int: ...  # the steps taken (a host count, saved in state_dict)
    @property
    def curvature(self) -> CurvatureCache: ...
    @property
    def param_groups(self) -> list[dict[str, Any]]: ...
    @property
    def strategy(self) -> Literal["auto", "factor", "materialize"]: ...
    @property
    def jacobian_budget(self) -> Optional[float]: ...
    @property
    def kl_clip(self) -> Optional[float]: ...
    @property
    def mc_loss(self) -> Literal["cross_entropy", "mse"]: ...
    @property
    def curvature_every(self) -> int: ...
    @property
    def curvature_samples(self) -> Optional[int]: ...
    @property
    def position_rows(self) -> Optional[int]: ...
    @property
    def cuda_graph(self) -> bool: ...  # reuse steps go through the graph runner (:mod:`.cuda_graphs`)
    @property
    def metric(self) -> Optional[Any]: ...  # the base metric (``root_every``: its S recomputed between curvature steps)
    def _group_params(self) -> list[Tensor]: ...


class SingleProcess(Sharding):
    """One process: the curvature of this process's batch, every layer solved here; the
    step's tensors are the whole parameters (:class:`~..step.sharding.Sharding`).

    Class attributes a strategy sets:
        saves_records: ``state_dict`` keeps the curvature records (bit-identical resume).
        whole_gradients: the groups :meth:`solve` applies read whole gradients, so
            push-through's probe of ``g = s·Jᵀ1`` can run (False: rows of them).
        agreed_skips: a skipped curvature step is re-taken as decided from the step's flag
            on curvature steps (one host read of a flag all ranks share); False: when the
            host first sees a skip (the non-blocking mirror, no read).
        fuses: ``compile``'s fused update may stand for a curvature step's :meth:`build_groups`
            and :meth:`solve`, i.e. they are one process's solve of every layer on its
            own batch; False: ``compile`` runs the modular path (no fused steps).
    """

    saves_records = True
    whole_gradients = True
    agreed_skips = False
    fuses = True

    LABEL = "TENGraD"  # the optimizer as users build it with this strategy (in errors)

    def check(self, options: dict[str, Any]) -> None:
        """``ValueError`` naming a TENGraD option this strategy does not run, at construction
        (``options``: every constructor argument but the model, name -> value as run,
        :func:`.options.built_options`): an option whose capability it :meth:`lacks`
        (:func:`.capabilities.refuse`, the same check for every strategy)."""
        refuse(self.LABEL, type(self).__name__, self.lacks(), options)

    def lacks(self) -> dict[str, str]:
        """``{capability: why not}``: the :data:`.capabilities.CAPABILITIES` this strategy
        does not provide, each with its physical reason; none here."""
        return {}

    @property
    def capturable(self) -> bool:
        """The step may run as a CUDA graph: the strategy :meth:`lacks` none of
        :data:`.capabilities.GRAPHS` (``cuda_graph=None`` turns graphs on for CUDA
        parameters only where it may)."""
        return not any(c in self.lacks() for c in GRAPHS)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The prepared model the optimizer reads (``model`` itself here)."""
        return model

    def bind(self, opt: Host) -> None:
        """Called once by TENGraD's constructor, after its options and layers are set; a
        model sharded by FSDP2 (DTensor parameters) is refused here: one process sees one shard."""
        if any(hasattr(p, "device_mesh") and hasattr(p, "to_local") for p in opt._group_params()):
            raise ValueError("TENGraD: the parameters are DTensors (a model sharded by torch.distributed.fsdp."
                             "fully_shard); use tengrad_fx.distributed.DistributedTENGraD(model, ...), which "
                             "preconditions each rank's shard with the global batch's Fisher")

    def reset(self, opt: Host) -> None:
        """The layers changed or a state was loaded: forget what was planned."""

    def batch_part(self) -> tuple[int, int]:
        """``(part, parts)``: this process's batch is part ``part`` of ``parts`` equal parts
        (in order) of the batch whose Fisher is taken; the whole batch here: ``(0, 1)``."""
        return 0, 1

    def curvature_part(self, opt: Host) -> tuple[int, int, Optional[Tensor]]:
        """``(part, parts, scored)``: :meth:`batch_part`, the batch where ``curvature_samples``
        and ``position_rows`` choose their rows; ``scored``: that batch's scored positions
        (None: this process's, ``store.scored``). The whole batch here: ``(0, 1, None)``."""
        return (*self.batch_part(), None)

    def initial_sites(self, opt: Host) -> set[int]:
        """The sites the first backward materializes (:mod:`.jacobian_sites`)."""
        return initial_jacobian_sites(opt._layers, opt.strategy, opt.jacobian_budget)

    def has_curvature(self, opt: Host) -> bool:
        """Is there curvature to reuse (else the next step takes it, whatever the schedule)?"""
        return opt.curvature.taken()

    def has_factors(self, opt: Host) -> bool:
        """Are the factors a reuse step solves with cached (else it runs eagerly, not as a
        CUDA graph)?"""
        return opt.curvature.chol is not None

    def mc_sample(self, opt: Host, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> Tensor:
        """The MC targets: ``targets`` where given, else drawn from the optimizer's generator
        for this process's part of the batch (:meth:`batch_part`, :func:`~..step.mc.sample_targets`:
        the processes' labels together are those one process draws for the whole batch from
        the same generator state)."""
        if targets is None:
            part, parts = self.batch_part()
            targets = sample_targets(outputs, opt.mc_loss, opt._mc_rng.get(outputs.device),
                                     check_mask(outputs, mask, opt.mc_loss), part, parts)
        return targets

    def backward_inputs(self, opt: Host, weights: list[Tensor]) -> list[Tensor]:
        """The tensors the sampled (MC / Gauss-Newton) backward differentiates: ``weights``,
        the covered layers' weights as the graph reads them."""
        return weights

    def restore_rows(self, opt: Host) -> None:
        """Before the metric's ``S`` is recomputed between curvature steps (``Metric.root_every``):
        the store holds this process's rows of the last curvature step, which the metric
        rescales and :meth:`begin` then moves. One process: they never left the store."""

    def begin(self, opt: Host, new_rows: bool) -> None:
        """Before the step's curvature work. ``new_rows``: a curvature step, or a step whose
        kept rows the metric rescaled; the rows move here to where their Grams are formed."""

    def solve_layers(self, opt: Host) -> list[CoveredLayer]:
        """The layers this process solves (their uncaptured weights are counted)."""
        return opt._layers

    def build_groups(self, opt: Host) -> list[LayerGroup]:
        """The groups of a curvature step, the last step's stacks refilled where the same
        layers were captured again (freed first otherwise); the store's materialized sites set."""
        cache, store = opt.curvature, opt._info.store
        old = cache.release()
        reuse = previous_stacks(old)
        kept = old if cache.static else []
        del old
        groups, sites = build_groups(opt._layers, opt.strategy, opt.jacobian_budget,
                                     uncaptured_sites(opt._layers, store.jacobian_sites), reuse=reuse,
                                     static=cache.static)
        store.jacobian_sites = sites
        cache.set_groups(groups, kept)
        return groups

    def after_factorize(self, opt: Host) -> None:
        """After a curvature step's factorization."""

    def solve(self, opt: Host, push_through: bool, damping: Damping) -> StepResult:
        """``{param: u}`` of every covered layer with a gradient, from :meth:`solved_groups`
        and the cached factors and dampings (:func:`.layer_groups.precondition`, its sums
        over shards by this strategy's :meth:`sum_parts`; ``Σ u·g`` and the gradients'
        ``Σ‖g‖²`` from its ``m``-vectors when the KL clip wants them); push-through where
        asked and :attr:`whole_gradients`."""
        cache = opt.curvature
        if not cache.groups or cache.chol is None:
            return StepResult({}, cache.ok)
        alphas = cache.dampings(damping, opt.param_groups)
        out, dots = precondition(self.solved_groups(opt), cache.chol, push_through and self.whole_gradients, alphas,
                                 opt._info.loss_reduction, dot=opt.kl_clip is not None, sharding=self)
        ug, gsq = dots if dots is not None else (None, None)
        return StepResult(out, cache.ok, ug, gsq)

    def solved_groups(self, opt: Host) -> list[LayerGroup]:
        """The groups :meth:`solve` applies, their layers in the cached factors' order: the
        cached groups themselves."""
        return opt.curvature.groups

    def finish(self, opt: Host, result: StepResult) -> StepResult:
        """The step's result as every process applies it (updates shared, flags agreed)."""
        return result

    def timings(self, begin_seconds: float) -> dict[str, float]:
        """More entries of ``opt.timings`` for this step (``begin_seconds``: :meth:`begin`'s)."""
        return {}

    def reuse_groups(self, opt: Host) -> list[LayerGroup]:
        """The cached groups a reuse step solves here (:meth:`TENGraD.reuse_cost`)."""
        return opt.curvature.groups
