"""``EKFAC``: eigenvalue-corrected K-FAC (George et al. 2018) over a prepared model.

Factors ``A, G`` and their eigenbases ``U_A, U_G`` exactly as :class:`~.kfac.KFAC` (same
scaling convention, running averages every ``curvature_every`` steps, eigendecompositions
every ``inverse_every`` steps, one Kronecker pair per conv group). The K-FAC eigenvalues ``d_G d_Aᵀ`` are
replaced by the diagonal second moment of the per-sample gradients in that basis,

    s = E_i[(U_Gᵀ ∇W_i U_A)²]      ([g, o, f + b], elementwise square)

where ``∇W_i = Σ_{calls, s} ğ_{i,s} ã_{i,s}ᵀ`` is sample ``i``'s gradient in matrix form (sum
over conv positions; bias as the homogeneous last column), computed exactly from the
captured ``I`` and ``G`` in sample chunks (never ``m`` full ``[o, f]`` matrices at once).
The update is

    u = (U_G ⊗ U_A) (diag(s) + λ)⁻¹ (U_G ⊗ U_A)ᵀ vec(∇W).

``s`` is re-estimated every ``rescale_every`` steps into a running average (``stat_decay``).
Whenever the eigenbasis changes, ``s`` restarts from ``d_G d_Aᵀ`` — the K-FAC scalings in
the new basis, as in alecwangcq/KFAC-Pytorch — and the same step's estimate (if it is a
``rescale_every`` step; step 0 always is) is averaged in. With ``stat_decay = 0`` the scalings
are exactly the current batch's. ``fisher="mc"`` uses ``G`` from :meth:`mc_capture`'s
sampled targets for both the factors and ``s``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..step.renamed import RenamedAttribute, renamed_keywords
from ._common import Block, SkipStep, check_interval, per_sample_grad_chunks, running
from .kfac import KFAC, KFAC_RENAMED

__all__ = ["EKFAC", "EKFAC_RENAMED", "ekfac_precondition", "projected_second_moment"]

# Deprecated keyword names of EK-FAC's options -> their names here (K-FAC's, plus the
# rescaling interval).
EKFAC_RENAMED = {**KFAC_RENAMED, "TScal": "rescale_every"}


def projected_second_moment(block: Block, UA: Tensor, UG: Tensor) -> Tensor:
    """``E_i[(U_Gᵀ ∇W_i U_A)²]``, ``[g, o, f+b]``, from the block's captured batch."""
    total = None
    m = 0
    for d in per_sample_grad_chunks(block, UA.dtype):  # [c, g, o, f+b]
        P = UG.transpose(1, 2) @ d @ UA
        sq = P.square().sum(0)
        total = sq if total is None else total + sq
        m += d.shape[0]
    assert total is not None
    return total / m


def ekfac_precondition(grad: Tensor, UA: Tensor, UG: Tensor, s: Tensor, damping: float) -> Tensor:
    """``(U_G ⊗ U_A)(diag(s) + λ)⁻¹(U_G ⊗ U_A)ᵀ vec(grad)`` per group; ``grad, s``: ``[g, o, f+b]``."""
    V = UG.transpose(1, 2) @ grad.to(UA.dtype) @ UA
    return UG @ (V / (s + damping)) @ UA.transpose(1, 2)


class EKFAC(KFAC):
    """EK-FAC over a prepared model.

    Args:
        model, lr, damping: as :class:`~.kfac.KFAC` (same defaults).

    Keyword-only:
        rescale_every: re-estimate the eigenbasis scalings ``s [g, o, f+b]`` every
            ``rescale_every`` steps (module docstring).
        kfac_options: every other option of :class:`~.kfac.KFAC`, with its default there:
            ``momentum``, ``stat_decay``, ``kl_clip``, ``weight_decay``, ``curvature_every``,
            ``inverse_every``, ``fisher``, ``mc_loss``, ``solve_dtype``, ``grad_scaler``,
            ``params``.

    Deprecated names, as keywords and as attributes: ``TScal`` → ``rescale_every`` and
    K-FAC's (``TCov``, ``TInv``, ``factor_dtype``).
    """

    NAME = "ekfac"
    CURVATURE = ("factors", "eig", "scales")  # type: ignore[assignment]
    TScal = RenamedAttribute("rescale_every")

    @renamed_keywords(**EKFAC_RENAMED)
    def __init__(self, model: torch.nn.Module, lr: float = 0.001, damping: float = 0.001, *,
                 rescale_every: int = 20, **kfac_options: Any):
        self.rescale_every = check_interval("rescale_every", rescale_every)
        super().__init__(model, lr, damping, **kfac_options)

    def _reset_curvature(self) -> None:
        super()._reset_curvature()
        self.scales: dict[int, Tensor] = {}  # block index -> s [g, o, f+b]

    def _needs_capture(self, step: int) -> bool:
        return super()._needs_capture(step) or step % self.rescale_every == 0

    def _update_curvature(self, step: int, captured: bool) -> None:
        if captured and super()._needs_capture(step):
            self._update_factors()
        for i in self._update_eigen(step):  # new basis: restart from the K-FAC scalings
            _, dA, _, dG = self.eig[i]
            self.scales[i] = dG.unsqueeze(2) * dA.unsqueeze(1)
        new_s: dict[int, Tensor] = {}
        if captured and step % self.rescale_every == 0:
            live = set(map(id, self._live_blocks()))
            for i, b in enumerate(self.blocks):
                if i in self.eig and id(b) in live:
                    UA, _, UG, _ = self.eig[i]
                    s = projected_second_moment(b, UA, UG)
                    if not bool(torch.isfinite(s).all()):
                        raise SkipStep(f"non-finite EKFAC scalings in layer '{b.layer.name}'")
                    new_s[i] = s
        for i, s in new_s.items():
            self.scales[i] = running(self.scales.get(i), s, self.stat_decay)

    def _layer_update(self, i: int, b: Block, damping: float) -> Tensor:
        UA, _, UG, _ = self.eig[i]
        return ekfac_precondition(b.grad_matrix(), UA, UG, self.scales[i], damping)
