"""``TENGraD``: natural gradient with exact Fisher-block inversion, as a torch optimizer.

Per covered layer (``m`` = curvature batch, ``α`` = damping)::

    u = (F + αI)⁻¹ g = (1/α)·(g − Jᵀ (J Jᵀ + mαI)⁻¹ J g),    F = JᵀJ / m

and, on a curvature step with the empirical Fisher (``g`` is the same batch's gradient,
``g = Jᵀ1/m`` for a mean loss), the push-through form ``u = Jᵀ (J Jᵀ + mαI)⁻¹ 1`` (no
``J g``, no cancellation of two nearly equal terms). Then, for every parameter (fallback
parameters use ``u = g``): ``d = ν·u + λw``, ``buf = μ·buf + d``, ``w ← w − lr·buf`` with
the KL clip ``ν = min(1, sqrt(kl_clip / (lr²·Σ u·g)))`` when ``kl_clip`` is set.

Training loop (every ``fisher``)::

    out = model(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()        # MC / Gauss-Newton: the sampled backward runs first (curvature steps)
    opt.step()

``opt.mc_capture(out)`` before ``loss.backward()`` runs that backward explicitly (the same
bits; needed for ``targets=``, a padding ``mask=``, or a loss that is not a function of
the output tensor): :meth:`~tengrad_fx.optim.step.skeleton.StepSkeleton.mc_capture`.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable, Iterable, Literal, Optional, Sequence

import torch
from torch import Tensor

from ...capture.info import get_info
from ...capture.prepare import capturing
from ..step.mc import mc_capture
from ..step.param_groups import Damping, grouped_layers, optimizer_params
from ..step.result import StepResult
from ..step.skeleton import StepSkeleton
from ..step.state_check import check_materialization, materialization_meta
from .cache import CurvatureCache
from .distribution import SingleProcess
from .fused_runner import FusedStep, fused_curvature_step
from .gauss_newton import gauss_newton_capture
from .cuda_graphs import GraphRunner
from .group_cost import reuse_cost
from ..step.renamed import respelled_keywords
from .metric import MetricOption, make_metric
from .options import Execution, built_options, check_options, jacobian_budget_bytes, use_cuda_graph
from .position_rows import position_sites
from .resume import load_state, save_state
from .schedule import CurvatureSchedule
from .shaping import UpdateShaping
from .spellings import respell_options
from .subsample import choose_rows

__all__ = ["TENGraD"]


class TENGraD(StepSkeleton):
    """TENGraD over a model returned by :func:`tengrad_fx.prepare`.

    The step reads nothing back from the device once warmed up (see
    :mod:`tengrad_fx.optim.step.skeleton`): non-finite values skip it by a masked update,
    Cholesky failures are caught by ``cholesky_ex`` with fixed batched jitter retries
    (:func:`tengrad_fx.solve.damped_cholesky_ex`), and the push-through/Woodbury choice
    is made on the device.

    Library defaults (no dataset named): the paper's ``T = 100`` and KL clip 0.01, with the
    empirical Fisher (docs/paper.md, "Fisher ablation": at ``T = 1`` without a clip it trains
    markedly worse; the paper's MC Fisher adds 0.2 % in 10 epochs of 3C1F, for an extra
    backward on curvature steps). Exact per-step updates: ``curvature_every=1, kl_clip=None``.

    Args:
        model: the prepared model.
        lr: learning rate (``>= 0``).
        damping: ``α > 0`` (a float; schedules set ``param_groups[i]["damping"]``; a layer
            takes its weight's group's).
        momentum, weight_decay: as in the paper's experiments (all methods).
        curvature_every: ``T >= 1`` (default 100, the paper's); on other steps the stored ``I, G`` (or materialized
            ``J``) of the last curvature step are reused and capture is switched off,
            so those forwards cost what SGD's cost.
        curvature_warmup, curvature_growth: curvature at every one of the first ``K`` steps, and/or an
            interval growing by ``r`` per curvature step up to ``T`` (:mod:`.schedule`; default: fixed ``T``).
        graft: ``None``, ``"sgd"`` or ``"rmsprop"``: each parameter's update rescaled to the norm of that
            method's step (:mod:`.graft`; lr in that method's units).
        orthogonalize: each ≥ 2-D weight's update replaced by its orthogonal polar factor at an RMS of 0.2
            (after any graft; :mod:`.graft`; lr in AdamW's units). ``True`` or ``"eigh"``: exact (an
            eigendecomposition per weight: a host read on CUDA, no CUDA graphs); ``"newton-schulz"``:
            Muon's five quintic steps (matmuls only; capturable). Default off: the update is NGD's.
            A param group with ``"orthogonalize": False`` keeps its weights' updates (grafted, if
            ``graft``): Muon's recipe leaves the embeddings and the output layer to Adam.
        orthogonalize_momentum: the polar factor of the momentum (Muon's order, Nesterov, the
            group's ``momentum``) instead of the heavy ball on the polar factors (:mod:`.shaping`).
        metric: ``u = (F + αD)⁻¹ g`` with a base metric ``D`` of mean eigenvalue 1 in place of
            ``I``, still exact by Woodbury; directions the rows do not span get ``D⁻¹g/α``.
            ``"factored"``: Kronecker-diagonal ``D`` from factored second moments of the gradients
            (Adafactor's; :mod:`.metric`). ``"kronecker"``: ``D = L^{1/2} ⊗ R^{1/2}`` of full
            matrices from Shampoo's ``L = E[g gᵀ]``, ``R = E[gᵀ g]`` (:mod:`.kronecker_metric`;
            an Embedding's vocabulary side and norm layers diagonal). None: ``D = I`` (the paper's).
            The moments' EMA factor: ``Metric("factored", beta2=0.9)`` (:class:`~.metric.Metric`;
            default 0.99); ``Metric(..., root_every=k)``: ``D`` recomputed every ``k`` steps between
            curvature steps, the kept rows' Grams refactorized (one process only; by default 5
            for ``"kronecker"``, never for ``"factored"``).
        relative_damping: each layer's ``α_l = α·tr(F_l)/m`` on the rows' span (``tr(K_l)/m²``: the
            mean of ``F_l``'s ``m`` eigenvalues there), so ``α`` is relative to the layer's own scale
            (:func:`.cache.relative_scales`); False: ``α`` as given (the paper's).
        curvature_samples: ``k``: the curvature of the first ``k`` samples of each curvature batch
            (:mod:`.subsample`; reuse steps cost ``∝ k``); every update is ``(F_k + αI)⁻¹ g``. None: all.
        position_rows: ``k``: Linear and Embedding layers over sequences take ``k`` rows drawn from
            their ``m·S`` (sample, position) pairs on each curvature step in place of one row per
            sample (K-FAC's "expand" rows, :mod:`.position_rows`; not with ``curvature_samples`` or
            the Gauss-Newton Fisher). None: one row per sample (the paper's).
        fisher: ``"empirical"`` (G from the training loss), ``"mc"`` (labels sampled from the model's
            prediction, :meth:`mc_capture`, run by the optimizer when the backward reaches the model's output;
            ``mc_loss``) or ``"gauss-newton"`` (exact GGN of ``½‖out − y‖²``, regression with ≤ 16 outputs:
            one backward per output; :mod:`tengrad_fx.optim.tengrad.gauss_newton`).
        mc_loss: ``"cross_entropy"`` (categorical sampling) or ``"mse"`` (Gaussian, unit
            variance; MC loss ``½‖out − ŷ‖²`` summed over outputs, mean over the batch).
        kl_clip: KL clipping threshold (``None``: off).
        update_form: ``"auto"`` (push-through on empirical curvature steps, Woodbury
            otherwise), ``"woodbury"`` (always the general form).
        solve_dtype: dtype of the m×m Cholesky (default: the parameters'); e.g. float64.
        jacobian_budget_mb: which layers the cost model materializes keep ``J`` between steps (the
            rest use theirs through ``I, G``). Default (None): each layer whose ``J`` is at most
            ``min(4, S/8)`` times its own ``I, G`` (``S`` positions per sample, at least 1×; a kept ``J``
            makes its reuse products ``S×`` cheaper: ``group_build.default_jacobian_cap``), or with
            ``strategy="materialize"`` a flat 1024 MiB. A number: a flat budget in MiB for all kept ``J``s,
            in layer order.
        strategy: Gram strategy for all layers: ``"auto"``, ``"factor"``, ``"materialize"``.
        compile: run the whole update (Gram → Cholesky → solve → Jᵀc over all layers,
            :func:`tengrad_fx.optim.tengrad.fused_update.fused_update`) under ``torch.compile``; layers
            of equal shapes share one ``vmap``. Falls back to eager, with one warning, if
            compilation fails or a layer has no fused form (conv/sequence by factor).
            A string (or callable) names the ``torch.compile`` backend (default ``"inductor"``).
        cuda_graph: on CUDA, capture the device part of reuse steps (no new curvature) as a
            CUDA graph per step kind and replay it (:mod:`tengrad_fx.optim.tengrad.cuda_graphs`); eager
            with one warning if capture fails; on a CPU the same code runs eagerly.
            Default (None): on when the parameters are on a CUDA device at construction, except
            under ``orthogonalize=True`` (its eigendecomposition cannot be captured; ``True`` there
            is a ValueError).
        gram_tf32: compute the curvature steps' Grams ``J Jᵀ`` of float32 layers with TF32
            tensor cores on CUDA (``layer_groups.tf32_matmuls``; ~1e-3 relative error in
            ``K``, the precision cuDNN's default TF32 convolutions already give ``P``).
        grad_scaler: the loop's ``torch.amp.GradScaler``: step with ``scaler.step(opt)``;
            autocast and loss scaling in :mod:`tengrad_fx.optim.step.amp`.
        params: parameters, or torch.optim param group dicts with their own ``lr``, ``damping``,
            ``momentum``, ``weight_decay`` (:mod:`tengrad_fx.optim.step.param_groups`); default:
            every parameter that requires grad, one group.
        distribution: how the step is spread over processes (:mod:`.distribution`): None or
            :class:`~.distribution.SingleProcess` (one process), or
            :class:`tengrad_fx.distributed.GlobalBatch` (the global batch's Fisher on a
            ``torch.distributed`` job; :class:`tengrad_fx.distributed.DistributedTENGraD`).

    Each option has this one spelling (:mod:`.spellings`; a param group may set ``lr``, ``damping``,
    ``momentum``, ``weight_decay`` and the ``orthogonalize`` flag: ``defaults``). Deprecated, with a
    ``DeprecationWarning`` naming the keywords to pass instead (with one of them: ``ValueError``):
    ``schedule=`` (an int or :class:`~.schedule.CurvatureSchedule`, now :attr:`schedule`),
    ``execution=`` (:class:`~.options.Execution`, now :attr:`execution`), ``metric_beta2=``.

    The optimizer's parts: :attr:`curvature` (:class:`~.cache.CurvatureCache`: groups, Grams,
    factors, schedule position), :attr:`graph_runner` (:class:`~.cuda_graphs.GraphRunner`) and
    :attr:`distribution`.
    """

    NAME = "tengrad"
    SYNC_FREE = True
    distribution: SingleProcess

    @respelled_keywords(respell_options)
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        damping: float,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        curvature_every: int = 100,
        curvature_warmup: int = 0,
        curvature_growth: Optional[float] = None,
        graft: Optional[str] = None,
        orthogonalize: bool | str = False,
        orthogonalize_momentum: bool = False,
        metric: MetricOption = None,
        relative_damping: bool = False,
        curvature_samples: Optional[int] = None,
        position_rows: Optional[int] = None,
        fisher: Literal["empirical", "mc", "gauss-newton"] = "empirical",
        mc_loss: Literal["cross_entropy", "mse"] = "cross_entropy",
        kl_clip: Optional[float] = 0.01,
        update_form: Literal["auto", "woodbury"] = "auto",
        solve_dtype: Optional[torch.dtype] = None,
        jacobian_budget_mb: Optional[float] = None,
        strategy: Literal["auto", "factor", "materialize"] = "auto",
        compile: Any = False,
        cuda_graph: Optional[bool] = None,
        gram_tf32: bool = False,
        grad_scaler: Optional[torch.amp.GradScaler] = None,
        params: Optional[Iterable[Any]] = None,
        distribution: Optional[SingleProcess] = None,
    ):
        self.schedule = CurvatureSchedule(curvature_every, curvature_warmup, curvature_growth)
        self.execution = ex = Execution(strategy=strategy, jacobian_budget_mb=jacobian_budget_mb, compile=compile,
                                        cuda_graph=cuda_graph, gram_tf32=gram_tf32, solve_dtype=solve_dtype)
        self.distribution = dist = SingleProcess() if distribution is None else distribution
        dist.check(built_options(TENGraD.__init__, locals()))
        model = dist.unwrap(model)
        info = get_info(model)  # raises ValueError for an unprepared model
        check_options(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay, fisher=fisher,
                      mc_loss=mc_loss, kl_clip=kl_clip, update_form=update_form,
                      curvature_samples=curvature_samples, position_rows=position_rows)
        self.curvature_samples, self.position_rows = curvature_samples, position_rows
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay,
                        orthogonalize=bool(orthogonalize))  # a group's flag; the method is the optimizer's
        super().__init__(optimizer_params(model, params, type(self).__name__), defaults)
        self._init_skeleton(model, info, grad_scaler)
        self.fisher, self.mc_loss, self.kl_clip = fisher, mc_loss, kl_clip
        self.shaping = UpdateShaping(graft, orthogonalize, orthogonalize_momentum, self.param_groups)
        self.metric = make_metric(metric)
        self.update_form = update_form
        self.solve_dtype, self.strategy, self.gram_tf32, self.compile = \
            ex.solve_dtype, ex.strategy, bool(ex.gram_tf32), bool(ex.compile)
        self.jacobian_budget_mb = ex.jacobian_budget_mb  # as given (checked when a state_dict is loaded)
        self.jacobian_budget = jacobian_budget_bytes(ex)
        self.cuda_graph = use_cuda_graph(ex, self.orthogonalize == "eigh", dist.capturable,
                                         any(p.is_cuda for p in self._group_params()))
        self.curvature = CurvatureCache(self.solve_dtype, self.gram_tf32, self.cuda_graph, relative_damping)
        self.graph_runner = GraphRunner(self.cuda_graph)
        self._fused = FusedStep((ex.compile if not isinstance(ex.compile, bool) else "inductor")
                                if self.compile else None)
        self._layers = grouped_layers(model, self.param_groups)  # weight in a group: curvature
        self._last_generation = info.store.generation
        self._gram_seconds = 0.0
        self._t_apply = 0.0  # when the update was ready (perf_counter): the "apply" timing starts there
        dist.bind(self)
        sites = dist.initial_sites(self)  # position rows are drawn from I, G: those layers start factored
        info.store.jacobian_sites = sites - position_sites(self._layers) if self.position_rows else sites
        self._watch_output()
        capturing(model, True)

    @property
    def graft(self) -> Optional[str]:
        """The ``graft`` option (:attr:`shaping`'s)."""
        return self.shaping.graft

    @property
    def orthogonalize(self) -> str | Literal[False]:
        """The polar factor's method, or False (:attr:`shaping`'s)."""
        return self.shaping.orthogonalize or False

    @property
    def curvature_every(self) -> int:
        """``T``: the schedule's interval (:attr:`schedule`)."""
        return self.schedule.every

    def _groups_changed(self) -> None:
        """Parameters were added: the layers are re-read, the next step takes curvature."""
        self._layers = grouped_layers(self.model, self.param_groups)
        self.curvature.clear()
        self.graph_runner.clear()
        self.distribution.reset(self)

    # ------------------------------------------------------------------ schedule
    def _needs_capture(self, step: int) -> bool:
        """Curvature as :attr:`schedule` says (skipped steps count: the skip is decided on
        the device), when none is cached, and once more after a skipped one was seen."""
        taken = self.curvature_steps if self.distribution.has_curvature(self) else 0
        return self.curvature.recapture or self.schedule.due(step, self.curvature.sched, taken)

    def reuse_cost(self) -> tuple[float, float]:
        """``(flops, bytes)`` of the curvature work of a step without new curvature, from
        the cached groups solved here (:func:`tengrad_fx.optim.tengrad.group_cost.reuse_cost`);
        zeros before the first curvature step or on the fused path."""
        groups = self.distribution.reuse_groups(self)
        return reuse_cost(groups) if groups else (0.0, 0.0)

    def curvature_spectrum(self) -> dict[str, dict[str, float]]:
        """Per layer of the last curvature step: its Fisher's eigenvalues on the rows' span
        against its damping (:meth:`~.cache.CurvatureCache.spectrum`). Where ``above_damping``
        is near 0, ``α`` swamps the curvature: that layer's step is ``g/α`` (``g/(αD)`` with a
        metric) up to a small correction. Empty before the first curvature step and on the fused path."""
        damping = self.curvature.damping
        if damping is None or not self.curvature.modular():
            return {}
        return self.curvature.spectrum(damping, self.param_groups)

    def _is_curvature_step(self) -> bool:
        return self._needs_capture(self._sched)

    def _roots_due(self, step: int) -> bool:
        """A reuse step on which the metric's ``S`` is recomputed (``Metric.root_every``)."""
        every = self.metric.root_every if self.metric is not None else None
        return every is not None and not self._needs_capture(step) and self.curvature.modular() \
            and (step - self.curvature.sched) % every == 0

    def _on_seen_skip(self) -> None:
        if not self.distribution.agreed_skips:
            self.curvature.recapture = True

    def _after_flags(self, stats_step: bool, ok: Tensor) -> None:
        if self.distribution.agreed_skips and stats_step and not bool(ok):  # one host read of a shared flag
            self.curvature.recapture = True

    def _mc_backward(self, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> None:
        """:meth:`mc_capture`'s backward: one of sampled labels (``fisher="mc"``), or one per
        output (``"gauss-newton"``: the exact GGN; no ``targets``/``mask`` there)."""
        weights = self.distribution.backward_inputs(
            self, [layer.weight for layer in self._layers if layer.weight.requires_grad])
        if self.fisher == "gauss-newton":
            if mask is not None or targets is not None:
                raise ValueError("mc_capture: targets and mask are for fisher='mc' "
                                 "(the Gauss-Newton Fisher samples nothing)")
            part, parts, _ = self.distribution.curvature_part(self)  # the global batch's first k samples
            gauss_newton_capture(self._info.store, outputs, weights, self._info.loss_reduction,
                                 loss_scale=self._loss_scale(), samples=self.curvature_samples, part=part, parts=parts)
        else:
            targets = self.distribution.mc_sample(self, outputs, targets, mask)
            mc_capture(self._info.store, outputs, self.mc_loss, weights, targets, self._loss_scale(), mask)

    # ------------------------------------------------------------------ curvature
    def _refresh(self, damping: Damping) -> None:
        """Grams and Cholesky factors of every layer solved here from the store, by groups of
        equal shape (:mod:`tengrad_fx.optim.tengrad.layer_groups`; the groups from
        :meth:`~.distribution.SingleProcess.build_groups`).

        Layers the cost model materializes (within ``jacobian_budget_mb``) are marked in
        the store, so later capturing backwards compute their per-sample gradients in
        place of the weight gradient (``P``), and the Gram is ``P Pᵀ``.
        """
        t_start = time.perf_counter()
        self.distribution.build_groups(self)
        self._gram_seconds = time.perf_counter() - t_start
        self.curvature.factorize(damping, self.param_groups)
        self.distribution.after_factorize(self)

    # ------------------------------------------------------------------ step (skeleton hooks)
    def _check_capture(self, stats_step: bool) -> None:
        store = self._info.store
        store.consume(self._info.loss_reduction)  # accumulated micro-batches: the union of their rows
        self._last_generation = store.generation

    def _updates(self, step: int, curvature_step: bool, mc_step: bool, damping: Damping) -> StepResult:
        result = self._natural_updates(step, curvature_step, mc_step, damping)
        result = self._shape_updates(result)
        now = time.perf_counter()
        self.timings["solve"] += now - self._t_apply
        self._t_apply = now
        return result

    def _natural_updates(self, step: int, curvature_step: bool, mc_step: bool, damping: Damping) -> StepResult:
        """``u = (F + αI)⁻¹ g`` of its layer for every covered parameter with a gradient
        (shared by the :attr:`distribution`), with the step's flags."""
        t0 = time.perf_counter()
        dist, cache, metric = self.distribution, self.curvature, self.metric
        subsampled = curvature_step and choose_rows(self)  # the rows are chosen first: the metric scales those
        roots = not curvature_step and self._roots_due(step)
        if metric is not None:
            metric.observe(self.state, self._layers)
            if curvature_step:  # the new records become the rows J S (before they move)
                metric.freeze(self.state, self._layers)
            elif roots:  # the kept rows become J S_new: their Grams are rebuilt below
                dist.restore_rows(self)
                metric.refresh_roots(self.state, self._layers)
        dist.begin(self, curvature_step or roots)  # new rows: moved to where the Grams are formed
        t_begin = time.perf_counter()
        self._gram_seconds = 0.0
        # push-through needs g = the captured batch's Jᵀ1: an empirical curvature step of the whole batch
        push_through = curvature_step and not mc_step and not subsampled and self.update_form == "auto"
        result = fused_curvature_step(self, push_through, damping) if curvature_step else None
        t1 = time.perf_counter()
        if result is None:  # the modular path
            if curvature_step or roots or not cache.modular():
                self._refresh(damping)
            elif damping != cache.damping:
                cache.factorize(damping, self.param_groups)
            t1 = time.perf_counter()
            with metric.scaled_grads(self.state, self._layers) if metric is not None else nullcontext():
                result = dist.solve(self, push_through, damping)
        if curvature_step:
            cache.sched, cache.recapture = step, False
        self._count_uncaptured(result.updates)
        t2 = time.perf_counter()
        self.timings = {"gram": self._gram_seconds, "factorize": t1 - t_begin - self._gram_seconds, "solve": t2 - t1}
        self._t_apply = t2  # the sharing and shaping of the updates count as "solve" (_updates)
        result = dist.finish(self, result)
        self.timings.update(dist.timings(t_begin - t0))
        return result if metric is None else metric.unscale(self.state, self._layers, result)

    def _shape_updates(self, result: StepResult) -> StepResult:
        """``graft``, ``orthogonalize_momentum`` and ``orthogonalize`` on the natural-gradient
        updates (of every layer: a distributed step shares them first; :mod:`.shaping`)."""
        return self.shaping.shape(result, self.param_groups, self._group_params(), self.state)

    def _momentum_parts(self, group: dict[str, Any]) -> list[tuple[list[Tensor], float]]:
        return self.shaping.momentum_parts(group)

    def _commit(self, ok: Optional[Tensor]) -> None:
        self.shaping.commit(ok)

    def _after_update(self, stats_step: bool, closure: Optional[Callable[[], Tensor]]) -> None:
        if self.timings:
            self.timings["apply"] = time.perf_counter() - self._t_apply

    def _run_device(self, stats_step: bool, fn: Callable[[Optional[Sequence[Tensor]]], Tensor]) -> Tensor:
        """Reuse steps with ``cuda_graph``: static gradients and lrs, then the graph of this
        kind (:class:`~.cuda_graphs.GraphRunner`); else eagerly."""
        runner = self.graph_runner
        eager = stats_step or self._roots_due(self._sched)  # a recomputation of S reads the eigensolver's status
        params = runner.params(eager, self.distribution.has_factors(self), self.param_groups, self.state)
        if params is None:
            return fn(None)
        # a replay runs no Python of the step: its whole device time is reported as "apply"
        self.timings, self._t_apply = {"gram": 0.0, "factorize": 0.0, "solve": 0.0}, time.perf_counter()
        return runner.run(params, self.param_groups, self.kl_clip, self.curvature.version, fn)

    def _count_uncaptured(self, updates: dict[Tensor, Tensor]) -> None:
        """Layers solved here with a weight gradient but no curvature (not called, or called
        with capture off, on this step's capture): their SGD-momentum updates are counted."""
        weights = (lay.weight for lay in self.distribution.solve_layers(self))
        self._add_uncaptured(sum(1 for w in weights if w.requires_grad and w.grad is not None and w not in updates))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Counters, momentum buffers, which layers the backward materializes, and (with
        ``curvature_every > 1``, when the next step reuses curvature and the distribution
        keeps records) the curvature records that step needs (:mod:`.resume`), so a resumed
        run continues bit for bit. Saved as a ``TENGraD`` state (any distribution loads it)."""
        return save_state(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load counters, momentum buffers and the saved curvature records (if any, and if
        the distribution keeps them; else the next step takes curvature: capture is switched
        on). Refuses another optimizer's state, parameter layout or materialization (``ValueError``)."""
        load_state(self, state_dict, super().load_state_dict)

    def _layout_meta(self) -> dict[str, Any]:
        return materialization_meta(self.strategy, self.jacobian_budget_mb, self._layers,
                                    self._info.store.jacobian_sites)

    def _check_layout_meta(self, meta: dict[str, Any]) -> None:
        check_materialization(meta, self.strategy, self.jacobian_budget_mb, self._layers)
