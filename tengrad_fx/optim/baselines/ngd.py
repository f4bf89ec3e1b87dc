"""``NGD``: exact block natural gradient with dense Fisher blocks (a reference baseline).

Per covered layer with ``n`` parameters (weight and bias together), from the exact
per-sample gradients ``J`` (``[m, n]``, :meth:`CoveredLayer.jacobian`)::

    F = JᵀJ / m      ([n, n], dense),        u = (F + αI)⁻¹ g      (Cholesky solve)

— the same update TENGraD computes through the ``m × m`` Woodbury identity, at
``O(n²m + n³)`` instead. Layers with ``n > max_params`` are refused at construction
(``ValueError`` naming the layer and ``n``). ``F`` is rebuilt every ``curvature_every``
steps (capture is switched off on the other steps). Only the Cholesky factor of
``F + αI`` is stored; it is refactorized if ``damping`` changes. ``fisher="mc"`` builds ``J``
from :meth:`mc_capture`'s sampled targets.
"""
from __future__ import annotations

from typing import Any, Iterable, Literal, Optional

import torch
from torch import Tensor

from ._common import CurvatureOptimizer, Damping, SkipStep, check_float_dtype, check_interval

__all__ = ["NGD"]


class NGD(CurvatureOptimizer):
    """Dense block NGD over a prepared model.

    Args:
        model: the prepared model.
        lr: learning rate (``>= 0``).
        damping: ``α > 0``.

    Keyword-only:
        momentum, weight_decay, kl_clip: as :class:`~tengrad_fx.optim.tengrad.TENGraD`.
        curvature_every: rebuild ``F`` every ``curvature_every`` steps.
        fisher, mc_loss: ``"empirical"`` / ``"mc"`` (see :meth:`mc_capture`).
        max_params: largest layer ``n`` accepted (``F`` takes ``n²`` numbers).
        solve_dtype: dtype of ``F`` and its Cholesky factor (default: the parameters').
    """

    NAME = "ngd"
    KRONECKER = False
    CURVATURE = ("_chol", "_chol_damping")

    def __init__(
        self,
        model: torch.nn.Module,
        lr: float,
        damping: float,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        kl_clip: Optional[float] = None,
        curvature_every: int = 1,
        fisher: Literal["empirical", "mc"] = "empirical",
        mc_loss: Literal["cross_entropy", "mse"] = "cross_entropy",
        max_params: int = 20000,
        solve_dtype: Optional[torch.dtype] = None,
        grad_scaler: Optional[torch.amp.GradScaler] = None,
        params: Optional[Iterable[Any]] = None,
    ):
        self.curvature_every = check_interval("curvature_every", curvature_every)
        self.max_params = check_interval("max_params", max_params)
        self.solve_dtype = check_float_dtype("solve_dtype", solve_dtype)
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        super().__init__(model, defaults, kl_clip=kl_clip, fisher=fisher, mc_loss=mc_loss,
                         grad_scaler=grad_scaler, params=params)
        for b in self.blocks:
            if b.numel > max_params:
                raise ValueError(
                    f"max_params: layer '{b.layer.name}' has n = {b.numel} parameters > max_params = "
                    f"{max_params}; its dense {b.numel}×{b.numel} Fisher block is too large "
                    "(use TENGraD, which inverts the same block through an m×m system)")
        self._reset_curvature()

    def _reset_curvature(self) -> None:
        self._chol: dict[int, Tensor] = {}   # lower Cholesky factor of F + αI, [n, n]
        self._chol_damping: dict[int, float] = {}  # the α in it

    def _needs_capture(self, step: int) -> bool:
        return step % self.curvature_every == 0 or not self._chol

    def _factor(self, i: int, M: Tensor, damping: float) -> Tensor:
        """Cholesky factor of ``M + damping·I`` (``M`` is overwritten)."""
        M.diagonal().add_(damping)
        L, info = torch.linalg.cholesky_ex(M)
        if int(info) != 0:
            raise SkipStep(f"F + αI not positive definite in layer '{self.blocks[i].layer.name}'")
        return L

    def fisher_block(self, i: int) -> Tensor:
        """The stored ``F`` of block ``i`` (``[n, n]``), rebuilt from its Cholesky factor."""
        L = self._chol[i]
        Fb = L @ L.T
        Fb.diagonal().sub_(self._chol_damping[i])
        return Fb

    def _update_curvature(self, step: int, captured: bool) -> None:
        """Only the Cholesky factor of ``F + αI`` is kept (``n²`` numbers per layer)."""
        dampings = self._block_dampings(self._damping())
        new: dict[int, Tensor] = {}
        if captured:
            live = self._live_blocks()
            for i, (b, damping) in enumerate(zip(self.blocks, dampings)):
                if b not in live:
                    continue
                J = b.layer.jacobian()
                if self.solve_dtype is not None:
                    J = J.to(self.solve_dtype)
                if not bool(torch.isfinite(J).all()):
                    raise SkipStep(f"non-finite per-sample gradients in layer '{b.layer.name}'")
                new[i] = self._factor(i, J.T @ J / J.shape[0], damping)
        for i in self._chol:
            if i not in new and self._chol_damping[i] != dampings[i]:  # damping changed: refactor
                new[i] = self._factor(i, self.fisher_block(i), dampings[i])
        for i, L in new.items():
            self._chol[i], self._chol_damping[i] = L, dampings[i]

    def _precondition(self, damping: Damping) -> dict[torch.nn.Parameter, Tensor]:
        out: dict[torch.nn.Parameter, Tensor] = {}
        for i, b in enumerate(self.blocks):
            if i not in self._chol or any(p.grad is None for p in b.params):
                continue
            L = self._chol[i]
            g = torch.cat([p.grad.flatten() for p in b.params]).to(L.dtype)  # type: ignore[union-attr]
            u = torch.cholesky_solve(g.unsqueeze(1), L).squeeze(1)
            off = 0
            for p in b.params:
                out[p] = u[off: off + p.numel()].view_as(p).to(p.dtype)
                off += p.numel()
        return out
