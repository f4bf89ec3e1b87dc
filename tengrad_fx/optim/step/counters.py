"""The counts every optimizer here keeps of its steps, and the one-time skip warning.

``state[NAME]`` holds the host counts (``step``, ``skipped``, ``curvature``,
``uncaptured``; saved in ``state_dict``). A step decided on the device (``SYNC_FREE``)
adds its ``[step, skipped]`` to a device tensor instead (:meth:`StepCounters._count`, in
place: a captured CUDA graph keeps adding to the same buffer); they join the host counts
when :attr:`StepCounters.counters` (or ``state_dict``) is read, and a non-blocking
device→host copy (:class:`.host.HostMirror`) lets a later step see a skip without waiting.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import Tensor

from .amp import scaler_enabled
from .host import HostMirror

__all__ = ["StepCounters"]


class StepCounters:
    """The step counts of :class:`~.skeleton.StepSkeleton` (module docstring); its
    ``_init_skeleton`` sets the attributes below."""

    NAME: str
    state: Any
    grad_scaler: Any
    _dev_counts: Optional[Tensor]  # [step, skipped] not yet added to the host counts
    _mirror: Optional[HostMirror]
    _seen_skips: int  # skips already seen on the host through the mirror
    _warned_skip: bool
    _kl_clipped: Optional[Tensor]  # device count of steps with KL-clip factor ν < 1
    _last_ok: Optional[Tensor]  # device bool: the last step's update was applied

    @property
    def counters(self) -> dict[str, int]:
        """``{"step": steps taken, "skipped": steps skipped for non-finite values,
        "uncaptured": layer-steps given the SGD-momentum update because the layer had a
        gradient but nothing captured}``
        (reading it waits for the device once when ``SYNC_FREE``)."""
        self._sync_counters()
        st = self.state[self.NAME]
        return {"step": st["step"], "skipped": st["skipped"], "uncaptured": st.get("uncaptured", 0)}

    @property
    def curvature_steps(self) -> int:
        """Steps that took new curvature / statistics (a host count, saved in ``state_dict``;
        a curvature step the device then skipped included)."""
        return int(self.state[self.NAME].get("curvature", 0))

    def _add_uncaptured(self, n: int) -> None:
        """Count ``n`` layer-steps given ``u = g`` for lack of a record (host count)."""
        if n:
            self.state[self.NAME]["uncaptured"] = self.state[self.NAME].get("uncaptured", 0) + n

    @property
    def step_applied(self) -> Optional[Tensor]:
        """Device ``bool`` scalar: the last ``step()`` applied its update (False: skipped),
        without a host read; None before the first step and after a step without gradients.
        A replayed CUDA graph returns the same (static) tensor each step: combine or copy it
        before the next step."""
        return self._last_ok

    @property
    def kl_clipped_steps(self) -> int:
        """Steps (since construction) whose update the KL clip scaled down, ``ν < 1``
        (reading it waits for the device once)."""
        return 0 if self._kl_clipped is None else int(self._kl_clipped)

    def _sync_counters(self) -> None:
        if self._dev_counts is None:
            return
        step, skipped = self._dev_counts.tolist()
        self._dev_counts.zero_()  # in place: a captured CUDA graph keeps adding to it
        if self._mirror is not None:
            self._mirror.reset()
        self._seen_skips = 0
        st = self.state[self.NAME]
        st["step"] += int(step)
        st["skipped"] += int(skipped)
        if skipped:
            self._on_seen_skip()
            self._warn_skip("non-finite gradient, curvature or update")

    def _count(self, ok: Tensor) -> None:
        inc = torch.stack([ok, ~ok]).to(torch.int64)
        if self._dev_counts is None:
            self._dev_counts = inc
            self._mirror = HostMirror(inc)
        else:
            self._dev_counts.add_(inc)  # in place: a static buffer for CUDA graphs

    def _poll_skips(self) -> None:
        """Warn (once) as soon as the host sees a device-side skip, without waiting."""
        if self._mirror is None:
            return
        vals = self._mirror.poll()
        if vals is not None and vals[1] > self._seen_skips:
            self._seen_skips = vals[1]
            self._on_seen_skip()
            self._warn_skip("non-finite gradient, curvature or update")

    def _on_seen_skip(self) -> None:
        """The host has just seen a device-side skip (TENGraD: re-capture curvature)."""

    def _warn_skip(self, why: str) -> None:
        if scaler_enabled(self.grad_scaler):
            return  # overflow skips are the scaler's routine; they are counted, not warned about
        if not self._warned_skip:
            warnings.warn(f"{type(self).__name__}: step skipped ({why}); parameters left unchanged. "
                          "Further skips are counted in opt.counters['skipped'].", RuntimeWarning)
            self._warned_skip = True
