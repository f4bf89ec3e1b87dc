"""The one step skeleton of TENGraD and the baselines (K-FAC, EK-FAC, KBFGS, NGD).

Per ``step()``::

    closure → hyper-parameters → which step kind (statistics/curvature or reuse, MC or not)
      → ok = finite(grads)                         (a device flag)
      → updates u (subclass: _updates)             (may raise SkipStep: a host-known skip)
      → ok &= finite(u) [& the subclass's flags]  → ν (KL clip, device scalar)
      → masked d = ν·u + λw, buf = μ·buf + d, w ← w − lr·buf   (update.apply_momentum_step)
      → counters, capture switched for the next step

``SYNC_FREE = True`` (TENGraD): the skip decision stays on the device; the parameters
are left bit for bit unchanged by a masked update, and the ``step``/``skipped`` counts
are device tensors added to the host counts when :attr:`counters` (or ``state_dict``)
is read. A skipped step still advances the curvature schedule. The one-time skip
warning is emitted when the host first sees a skip: a later ``step()`` polls a
non-blocking device→host copy of the counts (CUDA: pinned memory and an event, read only
once the event has completed, so the host never waits), or :attr:`counters` is read.
``SYNC_FREE = False`` (baselines): the flags are read on the host: a skipped
step changes nothing and does not advance their schedules.

Mixed precision: the captured records are converted to float32 (and unscaled) once per
capture before anything reads them; ``torch.amp.GradScaler`` steps go through
:mod:`tengrad_fx.optim.step.amp` (``grad_scaler=`` at construction, ``scaler.step(opt)``).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from torch import Tensor

from ...capture.info import PrepareInfo
from ...capture.output_hook import release, want_output
from ...capture.prepare import capturing
from .amp import loss_scale, scaler_flags, unscale_grads
from .update import all_finite, finite_flag, kl_clip_factor, update_dot
from .param_groups import (Damping, FrozenWatch, check_group, group_index, group_params, groups_damping, in_groups,
                           optimizer_params, same_lr, weighted_update_dot)
from .mc import MCState, SampleRNG, scored_mask, warn_unmasked
from .counters import StepCounters
from .host import HostMirror, SkipStep
from .result import StepResult
from .sharding import WHOLE, Sharding
from .reduction_check import check_loss_reduction
from .state_check import META, NamedParams, check_loadable, layout_meta, named_params
from ...curvature.layer import covered_layers

__all__ = ["StepSkeleton", "SkipStep", "HostMirror", "StepResult"]


class StepSkeleton(StepCounters, torch.optim.Optimizer):
    """Base of every optimizer here: the shared step (module docstring) over torch.optim
    param groups (:mod:`.param_groups`: per-group ``lr``, ``damping``, ``momentum``,
    ``weight_decay``; ``add_param_group`` rebuilds the covered layers, :meth:`_groups_changed`).

    Subclasses set ``NAME`` (key of the counters in ``self.state``) and implement
    :meth:`_needs_capture`, :meth:`_updates` (a :class:`~.result.StepResult`); optionally
    :meth:`_check_capture`, :meth:`_after_update`, :meth:`_run_device`, :meth:`_momentum_parts`,
    :meth:`_commit`. The step counts and skip warnings: :class:`~.counters.StepCounters`.
    """

    NAME = "optimizer"
    SYNC_FREE = False
    EMPTY_STEP_SKIPS = False  # a step without any gradient counts as skipped
    _step_supports_amp_scaling = True  # GradScaler.step hands over grad_scale/found_inf (.amp)
    # set by the subclasses' __init__; ``state`` holds the counters under ``NAME`` besides per-parameter state
    fisher: str
    mc_loss: Literal["cross_entropy", "mse"]
    kl_clip: Optional[float]
    state: defaultdict[Any, Any]
    distribution: Sharding = WHOLE  # where the step's tensors live (TENGraD: its strategy)

    def _init_skeleton(self, model: torch.nn.Module, info: PrepareInfo, grad_scaler: Any = None) -> None:
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise TypeError(f"{type(self).__name__}: grad_scaler must be a torch.amp.GradScaler, "
                            f"got {type(grad_scaler).__name__}")
        self.model = model
        self._info = info
        self.grad_scaler = grad_scaler
        self.state[self.NAME] = {"step": 0, "skipped": 0}
        self._sched = 0  # host count of the steps the statistics/curvature schedule has seen
        self._dev_counts: Optional[Tensor] = None  # [step, skipped] not yet added to the host counts
        self._mirror: Optional[HostMirror] = None
        self._seen_skips = 0  # skips already seen on the host through the mirror
        self._mc = MCState(self)  # shared with copies of this optimizer's __dict__ (wrappers)
        self._mc_rng = SampleRNG()  # the MC Fisher's label sampling (saved in state_dict)
        self._warned_skip = False
        self.timings: dict[str, float] = {}
        self._frozen = FrozenWatch(model, type(self).__name__)
        self._reduction_checked = False
        self._kl_clipped: Optional[Tensor] = None  # device count of steps with KL-clip factor ν < 1
        self._last_ok: Optional[Tensor] = None  # device bool: the last step's update was applied
        self.last_result: Optional[StepResult] = None  # the last eagerly run step's update computation
        self._built = True  # add_param_group from here on rebuilds (_groups_changed)

    # ------------------------------------------------------------------ param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, with each group's options checked (``ValueError`` naming the group).
        After construction the optimizer takes the added parameters in: covered layers
        whose weight is added join the curvature (:meth:`_groups_changed`; the curvature
        restarts from the next step's capture), the others get the fallback update."""
        super().add_param_group(param_group)
        built = getattr(self, "_built", False)
        try:  # a refused group is not kept
            check_group(self.param_groups[-1], len(self.param_groups) - 1, type(self).__name__)
            if built:
                optimizer_params(self.model, self.param_groups[-1:], type(self).__name__,
                                 len(self.param_groups) - 1)
        except ValueError:
            self.param_groups.pop()
            raise
        if built:
            self._groups_changed()
            capturing(self.model, self._needs_capture(self._sched))

    def _groups_changed(self) -> None:
        """The param groups gained parameters after construction: rebuild what depends on them."""

    def _group_params(self) -> list[Tensor]:
        """Every group's parameters, in group order."""
        return group_params(self.param_groups)

    def _damping(self) -> Damping:
        """This step's damping: one float, or one per group (:mod:`.param_groups`)."""
        return groups_damping(self.param_groups, type(self).__name__)

    # ------------------------------------------------------------------ subclass hooks
    def _needs_capture(self, step: int) -> bool:
        """Does step number ``step`` (schedule count) take new statistics/curvature?"""
        raise NotImplementedError

    def _check_capture(self, stats_step: bool) -> None:
        """Before the finiteness check: checks of what was captured (may raise/warn)."""

    def _updates(self, step: int, stats_step: bool, mc_step: bool, damping: Damping) -> StepResult:
        """This step's :class:`~.result.StepResult` (``{param: u}`` of the preconditioned
        parameters, optional device flags); raise :class:`SkipStep` to skip."""
        raise NotImplementedError

    def _before_step(self, closure: Optional[Callable[[], Tensor]]) -> None:
        """Called first in :meth:`step`, before the closure (may raise: KBFGS wants a closure)."""

    def _after_update(self, stats_step: bool, closure: Optional[Callable[[], Tensor]]) -> None:
        """Called after the parameters moved (KBFGS's same-batch secant pass)."""

    def _after_flags(self, stats_step: bool, ok: Tensor) -> None:
        """Called with this step's device flag (TENGraD: remember a failed curvature step)."""

    def _mc_backward(self, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> None:
        """The sampled backward(s) of :meth:`mc_capture` (records ``G`` only)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ MC / Gauss-Newton Fisher
    def mc_capture(self, outputs: Tensor, targets: Optional[Tensor] = None, mask: Optional[Tensor] = None) -> None:
        """MC Fisher (``fisher="mc"``; ``"gauss-newton"``: one backward per output): sample
        labels from ``outputs`` (``[m, *, c]``; or take ``targets``, ``[m, *]``, sampled by
        the caller) and run one backward of their loss that records ``G`` only (no
        parameter gradients), before ``loss.backward()``.

        Optional: without this call the optimizer runs the same backward itself when the
        training backward reaches the prepared model's output (:mod:`tengrad_fx.capture.output_hook`;
        the output must be a tensor or a mapping with ``"logits"``), with identical results.
        Call it to pass ``targets`` or ``mask`` (bool ``[m, *]``: the positions that count,
        e.g. ``labels != -100`` or ``attention_mask.bool()``; the others are neither sampled
        nor in the sampled loss), or when the loss is not a function of the model's output.
        Without ``mask`` the MC draw takes the positions the prepared model's call showed
        its loss scores (``labels=``, else ``attention_mask=``: :mod:`tengrad_fx.capture.scored`)
        where they fit ``outputs``; sequence logits with neither warn once. No-op for the
        empirical Fisher, on steps that take no curvature/statistics, and once this
        micro-batch's sampled backward has run (each accumulated micro-batch has its own).
        Called on a copy of the optimizer (one that copies its ``__dict__``, as Lightning's
        does), it runs on the original.
        """
        owner = self._mc.owner()
        if owner is not None and owner is not self:
            return owner.mc_capture(outputs, targets, mask)  # type: ignore[attr-defined]
        if self.fisher == "empirical" or self._mc.done or not self._needs_capture(self._sched):
            return None
        release(self._info.store.key)  # the output site: its backward is this one
        if self.fisher == "mc":
            mask = scored_mask(self._info.store, outputs, mask, self.mc_loss)
            if targets is None:
                warn_unmasked(self, self._mc, outputs, mask, self.mc_loss)
        self._mc_backward(outputs, targets, mask)
        self._mc.done = True
        return None

    def seed_mc(self, seed: int) -> None:
        """Seed the MC Fisher's label generator (default: one draw of the global RNG at the
        first sample; saved in ``state_dict``), as ``torch.manual_seed(seed)`` seeds the CPU's."""
        self._mc_rng.seed(seed)

    def _output_backward(self, outputs: Tensor) -> None:
        """The hook on the model's output (:mod:`tengrad_fx.capture.output_hook`)."""
        self.mc_capture(outputs)

    def _watch_output(self) -> None:
        """With an MC/Gauss-Newton Fisher, have capturing forwards hand their output to
        :meth:`_output_backward` (call after ``self.fisher`` is set)."""
        want_output(self._info.store.key, None if self.fisher == "empirical" else self._output_backward)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"tengrad_fx"``: who saved it (:mod:`.state_check`)."""
        self._sync_counters()
        sd = super().state_dict()
        sd[META] = layout_meta(type(self).__name__, self._named_params(), self._layout_meta())
        rng = self._mc_rng.state()
        if rng is not None:
            sd["state"][self.NAME] = dict(sd["state"][self.NAME], mc_rng=rng)
        return sd

    def _named_params(self) -> NamedParams:
        return named_params(self.model, self._group_params())  # type: ignore[arg-type]

    def _layout_meta(self) -> dict[str, Any]:
        """More entries of ``state_dict()["tengrad_fx"]`` that a loader must match."""
        return {}

    def _check_layout_meta(self, meta: dict[str, Any]) -> None:
        """Raise ``ValueError`` if the saved :meth:`_layout_meta` entries do not fit."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse (``ValueError``, nothing loaded) a state dict of another optimizer kind,
        parameter layout or materialization (:func:`.state_check.check_loadable`), then load."""
        meta = check_loadable(type(self).__name__, self.NAME, self._named_params(), len(self.param_groups),
                              state_dict)
        if meta is not None:
            self._check_layout_meta(meta)
        state_dict = {k: v for k, v in state_dict.items() if k != META}
        super().load_state_dict(state_dict)
        self._mc_rng.load(self.state[self.NAME].pop("mc_rng", None))
        self._dev_counts = None
        self._mirror = None
        st = self.state[self.NAME]
        self._sched = int(st.get("sched", st["step"]))

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:  # type: ignore[override]
        self._before_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        damping = self._damping()
        self._info.store.recording = True
        self._frozen.check(self.param_groups)
        k = self._sched
        stats_step = self._needs_capture(k)
        mc_step, self._mc.done = self._mc.done, False
        self._last_ok = None
        release(self._info.store.key)
        if stats_step and self.fisher != "empirical" and not mc_step:
            raise RuntimeError(f"{type(self).__name__}(fisher={self.fisher!r}): no sampled backward ran on this "
                               "statistics/curvature step: the training backward did not pass through the model's "
                               "output (a tensor, or a mapping with 'logits' or 'loss'); call "
                               "opt.mc_capture(outputs) before loss.backward()")
        grads = [p.grad for p in self._group_params() if p.grad is not None]
        if not grads:  # nothing to do, like torch's own optimizers
            return self._skip("no gradient", loss) if self.EMPTY_STEP_SKIPS else loss
        self._check_capture(stats_step)
        grad_scale, found_inf = scaler_flags(self)
        if grad_scale is not None:
            unscale_grads(grads, grad_scale)
        if found_inf is not None and (stats_step or not self.SYNC_FREE) and bool(found_inf):
            return self._skip("GradScaler found inf/NaN gradients", loss)  # one host read (.amp)
        self._info.store.finalize(self._record_inv_scale())
        if stats_step and not self._reduction_checked and self.fisher == "empirical" \
                and self.distribution.checks_loss_scale:
            self._reduction_checked = True  # once: a one-time host read (reduction_check)
            check_loss_reduction(covered_layers(self.model), self._info.loss_reduction, type(self).__name__)
        try:
            ok = self._run_device(stats_step, lambda lrs: self._device_step(k, stats_step, mc_step, damping, lrs))
        except SkipStep as exc:
            return self._skip(str(exc), loss)
        self._last_ok = ok
        if self.SYNC_FREE:
            self._after_flags(stats_step, ok)
            assert self._mirror is not None and self._dev_counts is not None
            self._mirror.post(self._dev_counts)
        else:
            self.state[self.NAME]["step"] += 1
        self._sched += 1
        self.state[self.NAME]["sched"] = self._sched
        if stats_step:
            self.state[self.NAME]["curvature"] = self.state[self.NAME].get("curvature", 0) + 1
        self._after_update(stats_step, closure)
        self._poll_skips()
        capturing(self.model, self._needs_capture(self._sched))
        return loss

    def _device_step(self, k: int, stats_step: bool, mc_step: bool, damping: Damping,
                     lrs: Optional[Sequence[Tensor]] = None) -> Tensor:
        """The device part of a step: finite check → ``u`` → flags → ``ν`` → update (per
        param group) → counts, masked on the device (``SYNC_FREE``) or checked on the host.
        ``lrs``: each group's lr as a static device scalar (a CUDA graph's), None: the
        groups' floats. Returns the step's flag; raises :class:`SkipStep` for a host-known
        skip (``SYNC_FREE = False``, or the warm-up read of the first step)."""
        if self.SYNC_FREE:
            self.last_result = self._updates(k, stats_step, mc_step, damping)
            return self._masked_step(self.last_result, lrs)
        return self._checked_step(k, stats_step, mc_step, damping, lrs)

    def _masked_step(self, result: StepResult, lrs: Optional[Sequence[Tensor]]) -> Tensor:
        """The step without a host read: one finiteness check of the gradients and the
        updates together (one ``_foreach_norm``; gradients a finite ``result.grad_sq``
        certifies are not read again), the update masked by the flag, counted on the device."""
        updates, checked, ug = self._kept(result)
        local = self.distribution.local
        grads = [local(p.grad) for p in self._group_params()
                 if p.grad is not None and (checked is None or p not in updates)]
        ok = self.distribution.agree(self._flag(finite_flag([*grads, *updates.values()], checked), result.ok))
        self._apply(updates, ug, lrs, ok, masked=True)
        self._count(ok)
        return ok

    def _checked_step(self, k: int, stats_step: bool, mc_step: bool, damping: Damping,
                      lrs: Optional[Sequence[Tensor]]) -> Tensor:
        """The step with host reads: the gradients before any curvature work, then the
        updates and flags; a non-finite one raises :class:`SkipStep` (nothing changed)."""
        if not all_finite([p.grad for p in self._group_params() if p.grad is not None]):
            raise SkipStep("non-finite gradient")
        result = self.last_result = self._updates(k, stats_step, mc_step, damping)
        updates, _, ug = self._kept(result)
        ok = self._flag(finite_flag(updates.values()), result.ok)
        if not bool(ok):
            raise SkipStep("non-finite preconditioned update")
        self._apply(updates, ug, lrs, ok, masked=False)
        return ok

    def _kept(self, result: StepResult) -> tuple[dict[Tensor, Tensor], Optional[Tensor], Optional[Tensor]]:
        """``(updates, grad_sq, update_dot)`` of the parameters in a group (parameters in
        no group are not updated, nor in ``ν`` or the check; then both sums are dropped)."""
        updates, groups = result.updates, self.param_groups
        if len(groups) > 1:
            kept = in_groups(updates, group_index(groups))
            if len(kept) != len(updates):
                return kept, None, None
        return updates, result.grad_sq, result.update_dot

    def _flag(self, finite: Optional[Tensor], extra: Optional[Tensor]) -> Tensor:
        """The step's device flag: ``finite`` (None: nothing checked, True) and ``extra``."""
        ok = finite if finite is not None else \
            torch.ones((), dtype=torch.bool, device=self._group_params()[0].device)
        return ok if extra is None else ok & extra

    def _apply(self, updates: dict[Tensor, Tensor], ug: Optional[Tensor], lrs: Optional[Sequence[Tensor]],
               ok: Tensor, masked: bool) -> None:
        """``ν`` (KL clip, counted when ``< 1``; ``Σ u·g`` over whole parameters:
        :meth:`.sharding.Sharding.sum_shards`), then each group's momentum step with its
        own lr, momentum and weight decay (:meth:`.sharding.Sharding.momentum_step`), masked by
        ``ok`` when ``masked``; a warm-up read of ``ok`` (the same flag for every group)
        that finds a skip leaves every group unchanged and raises :class:`SkipStep`."""
        groups, sharding = self.param_groups, self.distribution
        glrs: Sequence[float | Tensor] = lrs or [g["lr"] for g in groups]
        lr = glrs[0]
        if not same_lr(groups):  # ν from Σ_G lr_G²·Σ u·g (.param_groups)
            lr, ug = 1.0, (weighted_update_dot(updates, groups, glrs) if self.kl_clip is not None else None)
        if ug is None and self.kl_clip is not None and updates:
            ug = sharding.sum_shards(update_dot(updates, sharding.local), "sum of the row shards' u·g")
        nu = kl_clip_factor(updates, lr, self.kl_clip, ug)
        if nu is not None:  # counted on the device, in place (no sync; graph-safe); read by kl_clipped_steps
            if self._kl_clipped is None:
                self._kl_clipped = torch.zeros((), dtype=torch.int64, device=nu.device)
            self._kl_clipped.add_((nu < 1.0) & ok)
        reads = [sharding.momentum_step(self.state, ps, updates, glr, mu, g["weight_decay"], nu, ok if masked else None)
                 for g, glr in zip(groups, glrs) for ps, mu in self._momentum_parts(g)]
        if any(r is False for r in reads):  # the warm-up host read found a skip
            raise SkipStep("non-finite gradient, curvature or update")
        self._commit(ok if masked else None)

    def _momentum_parts(self, group: dict[str, Any]) -> list[tuple[list[Tensor], float]]:
        """``[(params, μ)]``: the parameters of ``group`` by the momentum of their step."""
        return [(group["params"], group["momentum"])]

    def _commit(self, ok: Optional[Tensor]) -> None:
        """Store state that waits for the step's flag ``ok`` (None: the step is taken)."""

    def _loss_scale(self) -> Optional[Tensor]:
        """The GradScaler's current scale (device scalar), None without one: what the
        optimizer's own capture backwards (MC, Gauss-Newton) multiply their loss by."""
        return loss_scale(self.grad_scaler, self._group_params()[0])

    def _record_inv_scale(self) -> Optional[Tensor]:
        """``1 / scale`` of the records not yet finalized (None: no scaler, or nothing new)."""
        if not self._info.store.needs_finalize():
            return None
        s = self._loss_scale()
        return None if s is None else s.double().reciprocal().float()

    def _run_device(self, stats_step: bool, fn: Callable[[Optional[Sequence[Tensor]]], Tensor]) -> Tensor:
        """Run the device part ``fn(lrs)`` (TENGraD: replays a CUDA graph of it when asked,
        with the groups' lrs as static device scalars; here the floats: ``lrs = None``)."""
        return fn(None)

    def _skip(self, why: str, loss: Optional[Tensor]) -> Optional[Tensor]:
        """A skip known on the host: nothing changes, the schedule does not advance."""
        self.state[self.NAME]["skipped"] += 1
        self._last_ok = torch.zeros((), dtype=torch.bool, device=self._group_params()[0].device)
        self._warn_skip(why)
        capturing(self.model, self._needs_capture(self._sched))
        return loss
