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
from typing import Any, Callable, Iterable, Literal, Optional

import torch
from torch import Tensor

from ...capture.info import get_info
from ...capture.prepare import capturing
from ..step.checks import check_choice, check_nonneg, check_positive, check_unit
from .gauss_newton import gauss_newton_capture
from ..step.mc import mc_capture
from .resume import CurvatureResume
from ..step.skeleton import StepSkeleton
from ..step.param_groups import Damping, grouped_layers, layer_dampings, optimizer_params
from ... import solve
from .graphs import ReuseGraphs, StepGraphs
from .group_build import build_groups, previous_stacks
from .jacobian_sites import JacobianSites
from .group_cost import reuse_cost
from .tengrad_groups import LayerGroup, precondition_groups, tf32_matmuls
from .fused_step import FusedStep
from .graft import GRAFT_BETA2, GRAFT_EPS, check_graft, check_orthogonalize, graft_updates, orthogonalize_updates, \
    orthogonalized
from .schedule import CurvatureSchedule
from .subsample import check_curvature_samples

__all__ = ["TENGraD"]


class TENGraD(CurvatureResume, ReuseGraphs, JacobianSites, StepSkeleton):
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
        curvature_samples: ``k``: the curvature of the first ``k`` samples of each curvature batch
            (:mod:`.subsample`; reuse steps cost ``∝ k``); every update is ``(F_k + αI)⁻¹ g``. None: all.
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
            rest use theirs through ``I, G``). Default (None): each layer whose ``J`` is no larger than its
            own ``I, G`` (``group_build.keeps_jacobian``), or with ``strategy="materialize"`` a flat
            1024 MiB. A number: a flat budget in MiB for all kept ``J``s, in layer order (more memory;
            faster reuse steps where ``J`` is larger than ``I, G`` on a CPU).
        strategy: Gram strategy for all layers: ``"auto"``, ``"factor"``, ``"materialize"``.
        compile: run the whole update (Gram → Cholesky → solve → Jᵀc over all layers,
            :func:`tengrad_fx.optim.tengrad.fused.fused_update`) under ``torch.compile``; layers
            of equal shapes share one ``vmap``. Falls back to eager, with one warning, if
            compilation fails or a layer has no fused form (conv/sequence by factor).
            A string (or callable) names the ``torch.compile`` backend (default ``"inductor"``).
        cuda_graph: on CUDA, capture the device part of reuse steps (no new curvature) as a
            CUDA graph per step kind and replay it (:mod:`tengrad_fx.optim.tengrad.graphs`); eager
            with one warning if capture fails; on a CPU the same code runs eagerly.
            Default (None): on when the parameters are on a CUDA device at construction, except
            under ``orthogonalize=True`` (its eigendecomposition cannot be captured; ``True`` there
            is a ValueError).
        gram_tf32: compute the curvature steps' Grams ``J Jᵀ`` of float32 layers with TF32
            tensor cores on CUDA (``tengrad_groups.tf32_matmuls``; ~1e-3 relative error in
            ``K``, the precision cuDNN's default TF32 convolutions already give ``P``).
        grad_scaler: the loop's ``torch.amp.GradScaler``: step with ``scaler.step(opt)``;
            autocast and loss scaling in :mod:`tengrad_fx.optim.step.amp`.
        params: parameters, or torch.optim param group dicts with their own ``lr``, ``damping``,
            ``momentum``, ``weight_decay`` (:mod:`tengrad_fx.optim.step.param_groups`); default:
            every parameter that requires grad, one group.
    """

    NAME = "tengrad"
    SYNC_FREE = True

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        damping: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        curvature_every: int = 100,
        curvature_warmup: int = 0,
        curvature_growth: Optional[float] = None,
        graft: Optional[str] = None,
        orthogonalize: bool | str = False,
        curvature_samples: Optional[int] = None,
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
    ):
        info = get_info(model)  # raises ValueError for an unprepared model
        check_nonneg("lr", lr)
        check_positive("damping", damping)
        check_unit("momentum", momentum)
        check_nonneg("weight_decay", weight_decay)
        self.schedule = CurvatureSchedule(curvature_every, curvature_warmup, curvature_growth)
        check_graft(graft, GRAFT_BETA2, GRAFT_EPS)
        self.curvature_samples = check_curvature_samples(curvature_samples)
        check_choice("fisher", fisher, ("empirical", "mc", "gauss-newton"))
        check_choice("mc_loss", mc_loss, ("cross_entropy", "mse"))
        if kl_clip is not None:
            check_positive("kl_clip", kl_clip)
        check_choice("update_form", update_form, ("auto", "woodbury"))
        check_choice("strategy", strategy, ("auto", "factor", "materialize"))
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        super().__init__(optimizer_params(model, params, type(self).__name__), defaults)
        self._init_skeleton(model, info, grad_scaler)
        self.curvature_every, self.graft = curvature_every, graft
        self.orthogonalize: str | Literal[False] = check_orthogonalize(orthogonalize) or False
        self.fisher = fisher
        self.mc_loss = mc_loss
        self.kl_clip = kl_clip
        self.update_form = update_form
        self.solve_dtype = solve_dtype
        if jacobian_budget_mb is not None:
            check_nonneg("jacobian_budget_mb", jacobian_budget_mb)
        self.jacobian_budget_mb = jacobian_budget_mb  # as given (checked when a state_dict is loaded)
        if jacobian_budget_mb is None and strategy == "materialize":
            jacobian_budget_mb = 1024.0  # every layer asked for as J: a flat budget
        self.jacobian_budget = None if jacobian_budget_mb is None else jacobian_budget_mb * 2**20
        self.strategy = strategy
        self.compile = bool(compile)
        eigh = self.orthogonalize == "eigh"
        if cuda_graph and eigh:
            raise ValueError("TENGraD(orthogonalize=True, cuda_graph=True): the polar factor's eigendecomposition "
                             "(cuSOLVER) cannot be captured in a CUDA graph; pass cuda_graph=False or leave it None "
                             "(off with orthogonalize), or orthogonalize='newton-schulz' (capturable)")
        # default: on when the parameters live on a CUDA device, off under an eigh polar factor (graphs.py)
        self.cuda_graph = not eigh and any(p.is_cuda for p in self._group_params()) \
            if cuda_graph is None else bool(cuda_graph)
        self.gram_tf32 = bool(gram_tf32)
        self._graphs = StepGraphs()
        self._graph_version = 0  # bumped when a static tensor of the captured step is replaced
        self._gbuf: dict[Tensor, Tensor] = {}  # static gradient buffers (cuda_graph)
        self._lr_buf: list[Tensor] = []  # static lr per group (cuda_graph)
        self._fused = FusedStep((compile if not isinstance(compile, bool) else "inductor") if self.compile else None)
        self._layers = grouped_layers(model, self.param_groups)  # weight in a group: curvature
        self._initial_jacobian_sites()
        self._curv: list[Any] = []  # LayerGroups (modular path) or (params, m) (fused path)
        self._chol: Optional[Tensor] = None  # [L_total, m, m]: all layers' factors, group order
        self._curv_damping: Optional[Damping] = None
        self._chol_ok: Optional[Tensor] = None  # device bool: every cached factor is valid
        self._step_flag: Optional[Tensor] = None  # extra device flag of the current step
        self._ug: Optional[Tensor] = None  # Σ u·g of the current step (precondition_groups), for the KL clip
        self._gsq: Optional[Tensor] = None  # Σ‖g‖² of its preconditioned parameters (their finiteness check)
        self._curv_sched = 0  # schedule count of the last curvature step
        self._recapture = False  # a skipped curvature step was seen: take curvature again
        self._warned_accum = False
        self._last_generation = info.store.generation
        self._gram_seconds = 0.0
        self._t_apply = 0.0  # when the update was ready (perf_counter): the "apply" timing starts there
        self._watch_output()
        capturing(model, True)

    def _groups_changed(self) -> None:
        """Parameters were added: the layers are re-read, the next step takes curvature."""
        self._layers = grouped_layers(self.model, self.param_groups)
        self._curv, self._chol, self._chol_ok = [], None, None
        self._graphs.clear()

    # ------------------------------------------------------------------ schedule
    def _needs_capture(self, step: int) -> bool:
        """Curvature as :attr:`schedule` says (skipped steps count: the skip is decided on
        the device), when none is cached, and once more after the host saw a skipped one."""
        taken = self.curvature_steps if self._curv else 0
        return self._recapture or self.schedule.due(step, self._curv_sched, taken)

    def reuse_cost(self) -> tuple[float, float]:
        """``(flops, bytes)`` of the curvature work of a step without new curvature, from
        the cached groups (:func:`tengrad_fx.optim.tengrad.group_cost.reuse_cost`); zeros
        before the first curvature step or on the fused path."""
        groups = [g for g in self._curv if isinstance(g, LayerGroup)]
        return reuse_cost(groups) if groups else (0.0, 0.0)

    def _is_curvature_step(self) -> bool:
        return self._needs_capture(self._sched)

    def _on_seen_skip(self) -> None:
        self._recapture = True

    def _mc_backward(self, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> None:
        """:meth:`mc_capture`'s backward: one of sampled labels (``fisher="mc"``), or one per
        output (``"gauss-newton"``: the exact GGN; no ``targets``/``mask`` there)."""
        weights = [layer.weight for layer in self._layers if layer.weight.requires_grad]
        if self.fisher == "gauss-newton":
            if mask is not None or targets is not None:
                raise ValueError("mc_capture: targets and mask are for fisher='mc' "
                                 "(the Gauss-Newton Fisher samples nothing)")
            gauss_newton_capture(self._info.store, outputs, weights, self._info.loss_reduction,
                                 loss_scale=self._loss_scale(), samples=self.curvature_samples)
        else:
            mc_capture(self._info.store, outputs, self.mc_loss, weights, targets, self._loss_scale(), mask,
                       self._mc_rng.get(outputs.device))

    # ------------------------------------------------------------------ curvature
    def _subsampled(self) -> bool:
        """The records cut to the first ``curvature_samples`` samples
        (:meth:`~tengrad_fx.capture.store.CaptureStore.keep_samples`); whether they are fewer than the batch."""
        return self.curvature_samples is not None and self._info.store.keep_samples(self.curvature_samples)

    def _refresh(self, damping: Damping) -> None:
        """Grams and Cholesky factors of every covered layer from the store, by groups of
        equal shape (:mod:`tengrad_fx.optim.tengrad.tengrad_groups`).

        Layers the cost model materializes (within ``jacobian_budget_mb``) are marked in
        the store, so later capturing backwards compute their per-sample gradients in
        place of the weight gradient (``P``), and the Gram is ``P Pᵀ``.
        """
        t_start = time.perf_counter()
        # the last curvature's stacks: a new capture of the same layers is copied into them
        # (build_groups' reuse); the others are freed before new ones are made. A captured
        # graph reads them: it stays valid while every group is the same tensors
        old, self._curv, self._K = self._curv, [], []
        reuse = previous_stacks([g for g in old if isinstance(g, LayerGroup)])
        kept = old if self.cuda_graph else []
        del old
        groups, sites = build_groups(self._layers, self.strategy, self.jacobian_budget, self._uncaptured_sites(),
                                     reuse=reuse, static=self.cuda_graph)
        self._info.store.jacobian_sites = sites
        if self.cuda_graph and not (len(kept) == len(groups) and all(o is n for o, n in zip(kept, groups))):
            self._graph_version += 1
        del kept
        with tf32_matmuls(self.gram_tf32):
            self._K = [grp.gram() for grp in groups]
        self._gram_seconds = time.perf_counter() - t_start
        self._curv = groups
        self._factorize(damping)

    def _layer_dampings(self, damping: Damping) -> Any:
        """``damping``, or the ``[L_total]`` ``α`` of the cached layers (group order)."""
        return layer_dampings(damping, self.param_groups, [lay for grp in self._curv for lay in grp.layers])

    def _factorize(self, damping: Damping) -> None:
        """One batched Cholesky of every layer's ``K + mαI`` (all layers share ``m``; ``α``
        per layer with per-group dampings)."""
        groups: list[LayerGroup] = self._curv
        old_chol, old_ok = self._chol, self._chol_ok
        self._chol, self._chol_ok = None, None
        if groups:
            m = groups[0].m
            if any(grp.m != m for grp in groups):
                raise RuntimeError("TENGraD: covered layers captured different batch sizes")
            K = self._K[0] if len(self._K) == 1 else torch.cat(self._K)
            chol, ok = solve.damped_cholesky_ex(K, m * self._layer_dampings(damping), self.solve_dtype)
            ok = ok.all()
            if self.cuda_graph and old_chol is not None and old_ok is not None and old_chol.shape == chol.shape \
                    and old_chol.dtype == chol.dtype:  # in place: static for a captured step (no copy without one)
                chol, ok = old_chol.copy_(chol), old_ok.copy_(ok)
            elif self.cuda_graph:
                self._graph_version += 1
            off = 0
            for grp, K in zip(groups, self._K):
                grp.chol = chol[off: off + K.shape[0]]
                off += K.shape[0]
            self._chol, self._chol_ok = chol, ok
        self._curv_damping = damping

    # ------------------------------------------------------------------ step (skeleton hooks)
    def _check_capture(self, stats_step: bool) -> None:
        store = self._info.store
        store.consume(self._info.loss_reduction)  # accumulated micro-batches: the union of their rows
        self._last_generation = store.generation

    def _updates(self, step: int, curvature_step: bool, mc_step: bool, damping: Damping) -> dict[Tensor, Tensor]:
        updates = self._shape_updates(self._natural_updates(step, curvature_step, mc_step, damping))
        now = time.perf_counter()
        self.timings["solve"] += now - self._t_apply
        self._t_apply = now
        return updates

    def _natural_updates(self, step: int, curvature_step: bool, mc_step: bool,
                         damping: Damping) -> dict[Tensor, Tensor]:
        """``{param: u}``, ``u = (F + αI)⁻¹ g`` of its layer, for every covered parameter with a gradient."""
        t0 = time.perf_counter()
        self._gram_seconds = 0.0
        self._step_flag = None
        self._ug = self._gsq = None
        updates = None
        subsampled = curvature_step and self._subsampled()
        # push-through needs g = the captured batch's Jᵀ1: an empirical curvature step of the whole batch
        push_through = curvature_step and not mc_step and not subsampled
        if self.compile and curvature_step and not isinstance(damping, tuple):  # else: the modular path
            fused = self._fused(self._layers, push_through and self.update_form == "auto", damping,
                                self._info.loss_reduction, self.solve_dtype)
            if fused is not None:  # keep the store's materialization choice as the modular path would
                updates, self._step_flag, self._curv = fused
                self._chol = None
                self._mark_jacobian_sites()
        t1 = time.perf_counter()
        if updates is None:  # the modular path
            if curvature_step or self._chol is None or not all(isinstance(g, LayerGroup) for g in self._curv):
                self._refresh(damping)
            elif damping != self._curv_damping:
                self._factorize(damping)
            t1 = time.perf_counter()
            updates = self._precondition(push_through, damping)
            self._step_flag = self._chol_ok
        if curvature_step:
            self._curv_sched = step
            self._recapture = False
        self._count_uncaptured(updates)
        t2 = time.perf_counter()
        self.timings = {"gram": self._gram_seconds, "factorize": t1 - t0 - self._gram_seconds,
                        "solve": t2 - t1}
        self._t_apply = t2
        return updates

    def _shape_updates(self, updates: dict[Tensor, Tensor]) -> dict[Tensor, Tensor]:
        """The ``graft`` and ``orthogonalize`` options on the natural-gradient updates (of every
        layer: a distributed optimizer shares the layers' updates first)."""
        if self.graft is not None:  # Σ u·g of the rescaled updates: computed by the KL clip itself
            params = self._group_params()
            if self.orthogonalize:  # a polar factor discards the grafted norm: those weights skip the graft
                params = [p for p in params if not orthogonalized(p, updates)]
            grafted = graft_updates(updates, params, self.state, self.graft, GRAFT_BETA2, GRAFT_EPS)
            updates, self._ug = {**updates, **grafted}, None
        if self.orthogonalize:
            updates, self._ug = orthogonalize_updates(updates, self.orthogonalize), None
        return updates

    def _device_flags(self) -> Optional[Tensor]:
        return self._step_flag

    def _update_dot(self) -> Optional[Tensor]:
        return self._ug

    def _checked_grads(self) -> Optional[Tensor]:
        return self._gsq

    def _after_update(self, stats_step: bool, closure: Optional[Callable[[], Tensor]]) -> None:
        if self.timings:
            self.timings["apply"] = time.perf_counter() - self._t_apply

    def _precondition(self, push_through: bool, damping: Damping) -> dict[Tensor, Tensor]:
        """``{param: u}`` for every parameter with a gradient of every covered layer
        (:func:`tengrad_fx.optim.tengrad.tengrad_groups.precondition_groups` over the cached groups
        and factors; the push-through form on empirical curvature steps, ``push_through``)."""
        groups: list[LayerGroup] = self._curv
        if not groups or self._chol is None:
            return {}
        out, dots = precondition_groups(groups, self._chol, push_through and self.update_form == "auto",
                                        self._layer_dampings(damping), self._info.loss_reduction,
                                        dot=self.kl_clip is not None)
        if dots is not None:
            self._ug, self._gsq = dots
        return out

    def _count_uncaptured(self, updates: dict[Tensor, Tensor]) -> None:
        """Layers with a weight gradient but no curvature (not called, or called with
        capture off, on this step's capture): their SGD-momentum updates are counted."""
        weights = (lay.weight for lay in self._layers)
        self._add_uncaptured(sum(1 for w in weights if w.requires_grad and w.grad is not None and w not in updates))
