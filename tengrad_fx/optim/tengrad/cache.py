"""TENGraD's curvature between steps: the layer groups of the last curvature step, their
Grams ``K = J Jᵀ`` and batched Cholesky factors of ``K + mαI``, and where that step was in
the schedule.

With ``static`` (a CUDA graph replays the reuse steps, :mod:`.cuda_graphs`) a new
factorization of the same shape is copied into the previous factor's memory, and
:attr:`CurvatureCache.version` bumps whenever a tensor a captured step reads is replaced.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from ... import solve
from ...curvature.layer import CoveredLayer
from ..step.param_groups import Damping, layer_dampings
from .layer_groups import LayerGroup, tf32_matmuls

__all__ = ["CurvatureCache", "layer_alphas", "relative_scales", "scaled_dampings"]


class CurvatureCache:
    """The cached curvature (module docstring).

    Attributes:
        groups: the :class:`~.layer_groups.LayerGroup` s of the last curvature step on the
            modular path (none after a fused one).
        fused: the last curvature step ran the fused update (``compile``): curvature was
            taken, no groups or factors are cached (the next step builds them).
        K: each group's Gram, ``[L_g, m, m]``.
        chol: ``[L_total, m, m]``: every layer's factor, group order (None: none cached).
        ok: device ``bool``: every cached factor is valid.
        damping: the damping ``chol`` was factorized with.
        relative: each layer's ``α_l = α·tr(K_l)/m²`` (:func:`relative_scales`, :func:`layer_alphas`), kept in
            :attr:`alphas` ``[L_total]``; the scales ``tr(K_l)/m²`` in :attr:`scales`
            ``[L_total]`` (None without ``relative`` or layers).
        sched: the schedule count of the last curvature step.
        recapture: the next step takes curvature whatever the schedule (a skipped one was seen).
        version: bumped when a static tensor of a captured step is replaced.
    """

    def __init__(self, solve_dtype: Optional[torch.dtype], gram_tf32: bool, static: bool, relative: bool = False):
        self.solve_dtype, self.gram_tf32, self.static, self.relative = solve_dtype, gram_tf32, static, relative
        self.alphas: Optional[Tensor] = None
        self.scales: Optional[Tensor] = None
        self.groups: list[LayerGroup] = []
        self.fused = False
        self.K: list[Tensor] = []
        self.chol: Optional[Tensor] = None
        self.ok: Optional[Tensor] = None
        self.damping: Optional[Damping] = None
        self.sched = 0
        self.recapture = False
        self.version = 0

    def clear(self) -> None:
        """No curvature cached: the next step takes it."""
        self.groups, self.chol, self.ok, self.fused = [], None, None, False

    def release(self) -> list[LayerGroup]:
        """The cached groups, no longer held here (their stacks may be refilled by the next build)."""
        old, self.groups, self.K = self.groups, [], []
        return old

    def taken(self) -> bool:
        """Is curvature cached (groups, or the fused update's step)?"""
        return bool(self.groups) or self.fused

    def set_fused(self, taken: bool) -> None:
        """A fused curvature step ran (``taken``: it had layers): nothing cached but that."""
        self.groups, self.K, self.chol, self.fused = [], [], None, taken

    def layers(self) -> list[CoveredLayer]:
        """The cached layers, group order."""
        return [lay for grp in self.groups for lay in grp.layers]

    def modular(self) -> bool:
        """Factors of :class:`LayerGroup` s are cached (the modular path can reuse them)."""
        return self.chol is not None

    def replaced(self) -> None:
        """Tensors a captured step reads were replaced outside the cache (e.g. new records):
        bump :attr:`version`, so graphs that read the old ones are dropped."""
        self.version += 1

    def set_groups(self, groups: list[LayerGroup], kept: Sequence[Any] = ()) -> None:
        """Cache ``groups`` and their Grams (``kept``: the previous groups, for the version)."""
        self.fused = False
        if self.static and not (len(kept) == len(groups) and all(o is n for o, n in zip(kept, groups))):
            self.version += 1
        with tf32_matmuls(self.gram_tf32):
            self.K = [grp.gram() for grp in groups]
        self.groups = groups

    def factorize(self, damping: Damping, param_groups: list[dict[str, Any]]) -> None:
        """One batched Cholesky of every layer's ``K + mαI`` (``α`` per layer with per-group
        dampings, :func:`~..step.param_groups.layer_dampings`; layers with fewer rows than
        the most, ``position_rows``, zero-padded: :mod:`tengrad_fx.solve.ragged`)."""
        groups = self.groups
        old_chol, old_ok = self.chol, self.ok
        self.chol, self.ok, self.scales = None, None, None
        if groups:
            ms = [grp.m for grp in groups for _ in grp.layers]
            M = max(ms)
            Ks = [solve.pad_gram(Kg, M) for Kg in self.K]
            K = Ks[0] if len(Ks) == 1 else torch.cat(Ks)
            m: Any = M if min(ms) == M else torch.tensor(ms, dtype=torch.float64, device=K.device)
            if self.relative:
                self.scales = relative_scales(K, m)
            alphas = self._kept(layer_alphas(damping, param_groups, self.layers(), self.scales))
            chol, ok = solve.damped_cholesky_ex(K, m * alphas, self.solve_dtype)
            ok = ok.all()
            if self.static and old_chol is not None and old_ok is not None and old_chol.shape == chol.shape \
                    and old_chol.dtype == chol.dtype:  # in place: static for a captured step (no copy without one)
                chol, ok = old_chol.copy_(chol), old_ok.copy_(ok)
            elif self.static:
                self.version += 1
            off = 0
            for grp, Kg in zip(groups, self.K):
                grp.chol = chol[off: off + Kg.shape[0]]
                off += Kg.shape[0]
            self.chol, self.ok = chol, ok
        self.damping = damping

    def spectrum(self, damping: Damping, param_groups: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
        """Per cached layer (its name): the eigenvalues ``λ`` of its Fisher on the rows' span,
        ``eig(K)/m`` of the Gram ``K [m, m]`` (with a metric, of ``D^{-1/2} F D^{-1/2}``, the
        matrix ``α`` is added to), against the layer's damping ``α``: ``{"rows": m, "damping": α,
        "largest": max λ, "mean": tr(K)/m², "above_damping": the share of the ``m`` with λ > α}``.
        Eigenvalues in float64; one host read per group (a diagnostic, not for the step)."""
        alphas = torch.as_tensor(self.dampings(damping, param_groups), dtype=torch.float64).cpu()
        alphas = alphas.expand(len(self.layers()))  # one α for all, or each layer's [L_total]
        out: dict[str, dict[str, float]] = {}
        off = 0
        for grp, Kg in zip(self.groups, self.K):
            lam = (torch.linalg.eigvalsh(Kg.detach().to(torch.float64)).clamp_min(0.0) / grp.m).cpu()  # [L_g, m]
            a = alphas[off: off + len(grp.layers)]
            above = (lam > a[:, None]).to(torch.float64).mean(-1)
            for lay, lam_l, a_l, ab in zip(grp.layers, lam, a.tolist(), above.tolist()):
                out[lay.name] = {"rows": grp.m, "damping": a_l, "largest": float(lam_l[-1]),
                                 "mean": float(lam_l.mean()), "above_damping": ab}
            off += len(grp.layers)
        return out

    def dampings(self, damping: Damping, param_groups: list[dict[str, Any]]) -> Any:
        """``damping``, or the ``[L_total]`` ``α`` of the cached layers (group order)."""
        if self.relative and self.alphas is not None:
            return self.alphas
        return layer_alphas(damping, param_groups, self.layers())

    def _kept(self, new: Any) -> Any:
        """The relative dampings ``new`` (as given without ``relative``), into :attr:`alphas`
        in place where it has their shape (a captured reuse step reads the same storage)."""
        if not self.relative:
            return new
        if self.alphas is not None and self.alphas.shape == new.shape and self.alphas.device == new.device:
            return self.alphas.copy_(new)
        self.alphas = new
        return new


def layer_alphas(damping: Damping, param_groups: list[dict[str, Any]], layers: list[CoveredLayer],
                 scales: Optional[Tensor] = None) -> Any:
    """The ``α`` of ``layers`` as their factors of ``K + mαI`` hold it: ``damping`` when it is
    one float and ``scales`` is None, else ``[len(layers)]`` float64: each layer's group's
    (:func:`~..step.param_groups.layer_dampings`) times its relative-damping scale
    (``scales [len(layers)]``, :func:`relative_scales`, by :func:`scaled_dampings`). Every
    process that holds the same ``α`` and ``s`` forms the same bits (a distributed layer's
    solver and the ranks that only apply it)."""
    alphas = layer_dampings(damping, param_groups, layers)
    return alphas if scales is None else scaled_dampings(alphas, scales)


def relative_scales(K: Tensor, m: Any = None) -> Tensor:
    """``[L]`` float64: ``tr(K_l)/m²`` of the Grams ``K [L, m, m]`` (``m``: the rows, ``K``'s
    size by default, or ``[L]`` for zero-padded Grams), the factor :func:`scaled_dampings`
    applies to ``α``. ``tr(K_l)/m²`` is the mean of the ``m`` eigenvalues of ``F_l = J_lᵀJ_l/m``
    on the rows' span, so ``α_l = α·tr(K_l)/m²`` is relative to each layer's own curvature
    (K-FAC's trace-normalized damping)."""
    m = K.shape[-1] if m is None else m
    return K.diagonal(dim1=-2, dim2=-1).sum(-1).to(torch.float64) / (m * m)


def scaled_dampings(alphas: Any, scales: Tensor) -> Tensor:
    """``α_l·s_l`` (``alphas``: ``α``, ``[L]`` or one layer's; ``scales`` the
    :func:`relative_scales` alike), floored at the least positive float64: the same bits
    wherever the same ``α`` and ``s`` meet (a distributed layer's solver and every rank)."""
    scale = alphas.to(scales.device) if isinstance(alphas, Tensor) else alphas
    return (scale * scales).clamp_min(torch.finfo(torch.float64).tiny)
