"""``EKFAC``: eigenvalue-corrected K-FAC (George et al. 2018) over a prepared model.

Factors ``A, G`` and their eigenbases ``U_A, U_G`` exactly as :class:`~.kfac.KFAC` (same
scaling convention, running averages every ``TCov`` steps, eigendecompositions every
``TInv`` steps, one Kronecker pair per conv group). The K-FAC eigenvalues ``d_G d_Aᵀ`` are
replaced by the diagonal second moment of the per-sample gradients in that basis,

    s = E_i[(U_Gᵀ ∇W_i U_A)²]      ([g, o, f + b], elementwise square)

where ``∇W_i = Σ_{calls, s} ğ_{i,s} ã_{i,s}ᵀ`` is sample ``i``'s gradient in matrix form (sum
over conv positions; bias as the homogeneous last column), computed exactly from the
captured ``I`` and ``G`` in sample chunks (never ``m`` full ``[o, f]`` matrices at once).
The update is

    u = (U_G ⊗ U_A) (diag(s) + λ)⁻¹ (U_G ⊗ U_A)ᵀ vec(∇W).

``s`` is re-estimated every ``TScal`` steps into a running average (``stat_decay``).
Whenever the eigenbasis changes, ``s`` restarts from ``d_G d_Aᵀ`` — the K-FAC scalings in
the new basis, as in alecwangcq/KFAC-Pytorch — and the same step's estimate (if it is a
``TScal`` step; step 0 always is) is averaged in. With ``stat_decay = 0`` the scalings
are exactly the current batch's. ``fisher="mc"`` uses ``G`` from :meth:`mc_capture`'s
sampled targets for both the factors and ``s``.
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional

import torch
from torch import Tensor

from ._common import Block, SkipStep, check_interval, per_sample_grad_chunks, running
from .kfac import KFAC

__all__ = ["EKFAC", "ekfac_precondition", "projected_second_moment"]


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
    """EKFAC over a prepared model. Arguments as :class:`~.kfac.KFAC`, plus
    ``TScal``: re-estimate the eigenbasis scalings every ``TScal`` steps."""

    NAME = "ekfac"
    CURVATURE = ("factors", "eig", "scales")  # type: ignore[assignment]

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 0.001,
        momentum: float = 0.9,
        stat_decay: float = 0.95,
        damping: float = 0.001,
        kl_clip: Optional[float] = 0.001,
        weight_decay: float = 0.0,
        TCov: int = 10,
        TScal: int = 20,
        TInv: int = 100,
        fisher: Literal["empirical", "mc"] = "empirical",
        mc_loss: Literal["cross_entropy", "mse"] = "cross_entropy",
        factor_dtype: Optional[torch.dtype] = None,
        grad_scaler: Optional[torch.amp.GradScaler] = None,
        params: Optional[Iterable[Any]] = None,
    ):
        self.TScal = check_interval("TScal", TScal)
        super().__init__(model, lr=lr, momentum=momentum, stat_decay=stat_decay, damping=damping,
                         kl_clip=kl_clip, weight_decay=weight_decay, TCov=TCov, TInv=TInv,
                         fisher=fisher, mc_loss=mc_loss, factor_dtype=factor_dtype, grad_scaler=grad_scaler,
                         params=params)

    def _reset_curvature(self) -> None:
        super()._reset_curvature()
        self.scales: dict[int, Tensor] = {}  # block index -> s [g, o, f+b]

    def _needs_capture(self, step: int) -> bool:
        return super()._needs_capture(step) or step % self.TScal == 0

    def _update_curvature(self, step: int, captured: bool) -> None:
        if captured and super()._needs_capture(step):
            self._update_factors()
        for i in self._update_eigen(step):  # new basis: restart from the K-FAC scalings
            _, dA, _, dG = self.eig[i]
            self.scales[i] = dG.unsqueeze(2) * dA.unsqueeze(1)
        new_s: dict[int, Tensor] = {}
        if captured and step % self.TScal == 0:
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
