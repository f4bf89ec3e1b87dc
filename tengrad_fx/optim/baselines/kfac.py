"""``KFAC``: Kronecker-factored approximate curvature (Martens & Grosse 2015; convolutions
as KFC, Grosse & Martens 2016), over a model prepared by :func:`tengrad_fx.prepare`.

Per covered layer, in matrix form ``[g, o, f + b]`` (see :mod:`._common`; the bias is the
homogeneous last column, ``ã = (a, 1)``), the Fisher block of each group is ``G ⊗ A``
(row-major ``vec``; equivalently ``A ⊗ G`` on column-major ``vec``) with

* ``A = Σ_{i,s} ã ãᵀ / (m·S)`` — unfolded input patches, mean over samples AND positions;
* ``G = Σ_{i,s} ğ ğᵀ / m`` — ``ğ = m·G_captured`` (per-sample output gradients of a mean
  loss), mean over samples, SUM over positions.

**Scaling convention.** ``G ⊗ A = (1/S)·E[Σ_s ggᵀ] ⊗ E[Σ_s ããᵀ]``, exactly KFC's ``Ω ⊗ Γ``
and exactly the product of the factors of alecwangcq/KFAC-Pytorch (``ComputeCovA`` /
``ComputeCovG`` with ``batch_averaged=True``, the code base whose ``TCov``/``TInv``
(here ``curvature_every``/``inverse_every``), ``stat_decay`` and ``kl_clip`` defaults this
class takes). That code splits the scalar
differently (its ``A`` is ours ``/S``, its ``G`` ours ``·S``); since damping is applied
to the product (below), every update is the same. For Linear (``S = 1``) the factors
themselves coincide.

**Damping.** Not split between the factors: with ``A = U_A diag(d_A) U_Aᵀ`` and
``G = U_G diag(d_G) U_Gᵀ`` (eigendecompositions every ``inverse_every`` steps),

    u = U_G [ (U_Gᵀ ∇W U_A) / (d_G d_Aᵀ + λ) ] U_Aᵀ  =  (G ⊗ A + λI)⁻¹ vec(∇W),

the exactly-damped Kronecker product (as KFAC-Pytorch does). Negative round-off
eigenvalues are clamped to 0.

**Statistics.** Every ``curvature_every`` steps the captured batch's ``A, G`` enter running averages
``F ← stat_decay·F + (1 − stat_decay)·F_batch``; the first estimate initializes them
(KFAC-Pytorch starts from the identity instead). Capture is switched off on the other
steps. ``fisher="mc"`` takes ``G`` from targets sampled by :meth:`mc_capture`.

**Groups.** Grouped / depthwise convolutions get one Kronecker pair per group (the Fisher
is block-diagonal over groups: different groups share no weights or inputs).

Differences from KFAC-Pytorch besides the above: weight decay is applied from the first
step (not after ``20·curvature_every`` steps), conv1d/conv3d, dilation, grouped convs and Linear on
``[m, *, d]`` inputs are covered, and non-finite steps are skipped.
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional

import torch
from torch import Tensor

from ..step.renamed import RenamedAttribute, renamed_keywords
from ._common import (Block, CurvatureOptimizer, Damping, SkipStep, check_interval, check_unit, layer_stats, running,
                      check_float_dtype)

__all__ = ["KFAC", "KFAC_RENAMED", "kfac_precondition", "sym_eig"]

# Deprecated keyword names of K-FAC's options (KFAC-Pytorch's names) -> their names here.
KFAC_RENAMED = {"TCov": "curvature_every", "TInv": "inverse_every", "factor_dtype": "solve_dtype"}


def sym_eig(M: Tensor) -> tuple[Tensor, Tensor]:
    """Eigen-decomposition of symmetric ``M [..., n, n]``: ``(d ≥ 0, U)``; retried in
    float64 (with a tiny jitter) if the native-dtype solver fails. Non-finite → SkipStep."""
    if not bool(torch.isfinite(M).all()):
        raise SkipStep("non-finite curvature factor")
    M = 0.5 * (M + M.transpose(-1, -2))
    try:
        d, U = torch.linalg.eigh(M)
    except RuntimeError:
        M64 = M.double()
        n = M.shape[-1]
        jit = 1e-12 * M64.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(1e-30)
        try:
            d, U = torch.linalg.eigh(M64 + jit * torch.eye(n, dtype=M64.dtype, device=M.device))
        except RuntimeError as exc:
            raise SkipStep(f"eigendecomposition failed: {exc}") from exc
        d, U = d.to(M.dtype), U.to(M.dtype)
    return d.clamp_min(0), U


def kfac_precondition(grad: Tensor, UA: Tensor, dA: Tensor, UG: Tensor, dG: Tensor, damping: float) -> Tensor:
    """``(G ⊗ A + λI)⁻¹ vec(grad)`` per group from eigendecompositions.

    grad: ``[g, o, f+b]``; ``UA [g, f+b, f+b]``, ``dA [g, f+b]``, ``UG [g, o, o]``, ``dG [g, o]``.
    """
    V = UG.transpose(1, 2) @ grad.to(UA.dtype) @ UA
    V = V / (dG.unsqueeze(2) * dA.unsqueeze(1) + damping)
    return UG @ V @ UA.transpose(1, 2)


class KFAC(CurvatureOptimizer):
    """K-FAC over a prepared model.

    Args:
        model: the prepared model.
        lr: learning rate (``>= 0``).
        damping: ``λ > 0`` added to the Kronecker product (also ``param_groups[i]["damping"]``:
            a layer takes its weight's group's).

    Keyword-only:
        momentum: heavy-ball ``μ`` in ``[0, 1)``.
        stat_decay: running-average decay of the factors, in ``[0, 1)``.
        kl_clip: KL-clip threshold (``None``: no clipping).
        weight_decay: ``λ_wd >= 0``: ``d = ν·u + λ_wd·w``.
        curvature_every: factor statistics every ``curvature_every`` steps (capture on only then).
        inverse_every: eigendecompositions every ``inverse_every`` steps.
        fisher: ``"empirical"`` or ``"mc"`` (the sampled backward runs when the training backward
            reaches the model's output, or at :meth:`mc_capture` before it).
        mc_loss: ``"cross_entropy"`` or ``"mse"`` (MC target distribution).
        solve_dtype: dtype of factors and eigendecompositions (default: the parameters').
        grad_scaler: the loop's ``torch.amp.GradScaler`` (step with ``scaler.step(opt)``;
            the records are unscaled with it, :mod:`tengrad_fx.optim.step.amp`). Every baseline
            takes it.
        params: the parameters to train, or param group dicts, as
            :class:`~tengrad_fx.optim.tengrad.TENGraD`'s (every baseline takes it).

    Deprecated names, as keywords and as attributes (``DeprecationWarning``; a keyword
    given under both names is a ``TypeError``): ``TCov`` → ``curvature_every``, ``TInv`` →
    ``inverse_every``, ``factor_dtype`` → ``solve_dtype``.
    """

    NAME = "kfac"
    CURVATURE = ("factors", "eig")
    TCov = RenamedAttribute("curvature_every")
    TInv = RenamedAttribute("inverse_every")
    factor_dtype = RenamedAttribute("solve_dtype")

    @renamed_keywords(**KFAC_RENAMED)
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 0.001,
        damping: float = 0.001,
        *,
        momentum: float = 0.9,
        stat_decay: float = 0.95,
        kl_clip: Optional[float] = 0.001,
        weight_decay: float = 0.0,
        curvature_every: int = 10,
        inverse_every: int = 100,
        fisher: Literal["empirical", "mc"] = "empirical",
        mc_loss: Literal["cross_entropy", "mse"] = "cross_entropy",
        solve_dtype: Optional[torch.dtype] = None,
        grad_scaler: Optional[torch.amp.GradScaler] = None,
        params: Optional[Iterable[Any]] = None,
    ):
        self.stat_decay = check_unit("stat_decay", stat_decay)
        self.curvature_every = check_interval("curvature_every", curvature_every)
        self.inverse_every = check_interval("inverse_every", inverse_every)
        self.solve_dtype = check_float_dtype("solve_dtype", solve_dtype)
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        super().__init__(model, defaults, kl_clip=kl_clip, fisher=fisher, mc_loss=mc_loss,
                         grad_scaler=grad_scaler, params=params)
        self._reset_curvature()

    # ------------------------------------------------------------------ curvature
    def _reset_curvature(self) -> None:
        self.factors: dict[int, tuple[Tensor, Tensor]] = {}  # block index -> (A, G) running
        self.eig: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # -> (UA, dA, UG, dG)

    def _needs_capture(self, step: int) -> bool:
        return step % self.curvature_every == 0 or not all(i in self.factors for i in range(len(self.blocks)))

    def _batch_factors(self) -> dict[int, tuple[Tensor, Tensor]]:
        """``{block index: (A, G)}`` of the captured batch for blocks with a gradient."""
        live = set(map(id, self._live_blocks()))
        new = {}
        for i, b in enumerate(self.blocks):
            if id(b) not in live:
                continue
            st = layer_stats(b, self.solve_dtype)
            if not (torch.isfinite(st.A).all() and torch.isfinite(st.G).all()):
                raise SkipStep(f"non-finite K-FAC factors in layer '{b.layer.name}'")
            new[i] = (st.A, st.G)
        return new

    def _update_factors(self) -> None:
        for i, (A, G) in self._batch_factors().items():
            old = self.factors.get(i)
            self.factors[i] = (running(old[0] if old else None, A, self.stat_decay),
                               running(old[1] if old else None, G, self.stat_decay))

    def _update_eigen(self, step: int) -> list[int]:
        """Eigendecompose the running factors on ``inverse_every`` steps (or where missing).
        Returns the block indices whose basis changed."""
        changed = []
        for i, (A, G) in self.factors.items():
            if step % self.inverse_every == 0 or i not in self.eig:
                dA, UA = sym_eig(A)
                dG, UG = sym_eig(G)
                self.eig[i] = (UA, dA, UG, dG)
                changed.append(i)
        return changed

    def _update_curvature(self, step: int, captured: bool) -> None:
        if captured:
            self._update_factors()
        self._update_eigen(step)

    def _precondition(self, damping: Damping) -> dict[torch.nn.Parameter, Tensor]:
        out: dict[torch.nn.Parameter, Tensor] = {}
        for i, (b, lam) in enumerate(zip(self.blocks, self._block_dampings(damping))):
            if i not in self.eig or any(p.grad is None for p in b.params):
                continue
            out.update(b.split(self._layer_update(i, b, lam)))
        return out

    def _layer_update(self, i: int, b: Block, damping: float) -> Tensor:
        UA, dA, UG, dG = self.eig[i]
        return kfac_precondition(b.grad_matrix(), UA, dA, UG, dG, damping)
