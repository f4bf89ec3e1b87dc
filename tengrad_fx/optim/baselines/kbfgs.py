"""``KBFGS``: Kronecker-factored BFGS (Goldfarb, Ren & Bahamou 2020) over a prepared model.

Per covered layer (matrix form ``[g, o, f + b]``, bias = homogeneous last column, one
pair per conv group) the update is ``u = H_G ∇W H_A`` with

* ``H_A = (A + √λ·I)⁻¹`` — ``A`` the K-FAC input factor of :mod:`.kfac` (mean over samples
  and positions of ``ã ãᵀ``, running average ``stat_decay`` every ``curvature_every`` steps),
  inverted by Cholesky every ``inverse_every`` steps (and when ``damping`` changes);
* ``H_G ≈ (G + √λ·I)⁻¹`` — maintained by damped BFGS on the pair

      s = Δ h̄,  y = Δ ḡ,   h̄ = mean_{i,s} of the pre-activation = W̃ ā,
                            ḡ = Σ_s mean_i of the per-sample output gradient ğ

  (``ā``, ``ḡ`` from the captured ``I``, ``G`` — the pre-activation mean is recomputed as
  ``W̃ ā`` from the layer input, never stored). ``H_G`` starts at ``I``.

**Damping split.** ``λ`` (``damping``) is split as ``√λ`` on each side: ``√λ·I`` added to
``A`` and, on the ``G`` side, Levenberg–Marquardt damping ``y ← y + √λ·s`` after Powell
damping (:func:`damped_bfgs_update`), so ``H_G`` targets ``(G + √λ I)⁻¹``.

**Powell damping** (inverse form, ``μ₁ = powell``): if ``sᵀy < μ₁·yᵀH y`` then
``s ← θ s + (1 − θ) H y`` with ``θ = (1 − μ₁) yᵀHy / (yᵀHy − sᵀy)``, which makes
``sᵀy = μ₁ yᵀHy > 0``; with the LM term ``sᵀy > 0`` always, so ``H_G`` stays positive
definite. Then the BFGS inverse update ``H ← (I − ρ s yᵀ) H (I − ρ y sᵀ) + ρ s sᵀ``,
``ρ = 1/sᵀy``, satisfies the secant equation ``H y = s`` for the damped pair.

**Simplifications** (stated): full BFGS on the ``o × o`` ``H_G`` (not L-BFGS); the pairs
come from captures only, i.e. every ``curvature_every`` steps (the paper updates every step). With
``secant="consecutive"`` (default) the pair is the difference between this capture and
the previous one — different minibatches, no extra pass. With ``secant="same_batch"``
(the paper's scheme) pass ``step(closure)``: after the update the closure is called
again on the same batch (it must ``zero_grad``, forward, ``backward``), and the pair is
the change of ``h̄, ḡ`` across the step. Convolutions (not in the 2020 paper) use the
scaling above so ``H_G ⊗ H_A`` matches the K-FAC factors' scale. Empirical gradients only
(there is no MC-Fisher option).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, Optional

import torch
from torch import Tensor

from ...capture.switch import capturing
from ..step.renamed import RenamedAttribute, renamed_keywords
from ._common import (Block, CurvatureOptimizer, Damping, SkipStep, check_choice, check_interval, check_unit,
                      layer_stats, running)

__all__ = ["KBFGS", "KBFGS_RENAMED", "damped_bfgs_update"]

# Deprecated keyword names of K-BFGS's options -> their names here.
KBFGS_RENAMED = {"TCov": "curvature_every", "TInv": "inverse_every"}


def damped_bfgs_update(H: Tensor, s: Tensor, y: Tensor, powell: float = 0.2,
                       lm: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """One damped BFGS update of an inverse approximation, batched.

    Args:
        H: ``[..., n, n]`` symmetric positive definite.
        s, y: ``[..., n]`` the raw pair.
        powell: Powell's ``μ₁`` in ``(0, 1)``.
        lm: Levenberg–Marquardt ``y ← y + lm·s`` (after Powell damping), ``>= 0``.

    Returns ``(H⁺, s̃, ỹ)``, with ``H⁺ ỹ = s̃``. Batch entries whose damped ``s̃ᵀỹ`` is not
    positive (e.g. ``s = y = 0``) keep ``H``.
    """
    if not 0 < powell < 1:
        raise ValueError(f"powell must be in (0, 1), got {powell!r}")
    if not lm >= 0:
        raise ValueError(f"lm must be >= 0, got {lm!r}")
    Hy = (H @ y.unsqueeze(-1)).squeeze(-1)
    yHy = (y * Hy).sum(-1, keepdim=True)
    sy = (s * y).sum(-1, keepdim=True)
    damp = sy < powell * yHy
    theta = torch.where(damp, (1 - powell) * yHy / torch.where(damp, yHy - sy, torch.ones_like(sy)),
                        torch.ones_like(sy))
    s_t = theta * s + (1 - theta) * Hy
    y_t = y + lm * s_t
    sy_t = (s_t * y_t).sum(-1, keepdim=True)
    scale = (s_t.norm(dim=-1, keepdim=True) * y_t.norm(dim=-1, keepdim=True)).clamp_min(torch.finfo(H.dtype).tiny)
    ok = sy_t > 1e-12 * scale
    rho = torch.where(ok, 1.0 / torch.where(ok, sy_t, torch.ones_like(sy_t)), torch.zeros_like(sy_t))
    # H⁺ = H − ρ(s (Hy)ᵀ + (Hy) sᵀ) + (ρ² yᵀHy + ρ) s sᵀ, with ỹ in place of y
    Hy_t = (H @ y_t.unsqueeze(-1)).squeeze(-1)
    yHy_t = (y_t * Hy_t).sum(-1, keepdim=True)
    r = rho.unsqueeze(-1)
    outer = lambda a, b: a.unsqueeze(-1) * b.unsqueeze(-2)
    Hn = H - r * (outer(s_t, Hy_t) + outer(Hy_t, s_t)) + (r * r * yHy_t.unsqueeze(-1) + r) * outer(s_t, s_t)
    Hn = 0.5 * (Hn + Hn.transpose(-1, -2))
    return Hn, s_t, y_t


class KBFGS(CurvatureOptimizer):
    """K-BFGS over a prepared model.

    Args:
        model, lr: as :class:`~.kfac.KFAC`.
        damping: ``λ > 0``, split ``√λ`` / ``√λ`` (module docstring).

    Keyword-only:
        momentum, weight_decay, kl_clip: as :class:`~.kfac.KFAC` (``kl_clip`` off by default).
        stat_decay: running-average decay of ``A``, in ``[0, 1)``.
        curvature_every: capture (``A`` statistics and a BFGS pair) every ``curvature_every`` steps.
        inverse_every: recompute ``H_A`` every ``inverse_every`` steps.
        powell: Powell damping ``μ₁`` in ``(0, 1)``.
        secant: ``"consecutive"`` or ``"same_batch"`` (needs ``step(closure)``).
        grad_scaler, params: as :class:`~.kfac.KFAC`.

    Deprecated names, as keywords and as attributes: ``TCov`` → ``curvature_every``,
    ``TInv`` → ``inverse_every``.
    """

    NAME = "kbfgs"
    CURVATURE = ("A", "HA", "HG", "_HA_damping", "_prev", "pairs")
    SUPPORTS_MC = False
    TCov = RenamedAttribute("curvature_every")
    TInv = RenamedAttribute("inverse_every")

    @renamed_keywords(**KBFGS_RENAMED)
    def __init__(
        self,
        model: torch.nn.Module,
        lr: float = 0.001,
        damping: float = 0.001,
        *,
        momentum: float = 0.9,
        stat_decay: float = 0.95,
        kl_clip: Optional[float] = None,
        weight_decay: float = 0.0,
        curvature_every: int = 10,
        inverse_every: int = 100,
        powell: float = 0.2,
        secant: Literal["consecutive", "same_batch"] = "consecutive",
        grad_scaler: Optional[torch.amp.GradScaler] = None,
        params: Optional[Iterable[Any]] = None,
    ):
        self.stat_decay = check_unit("stat_decay", stat_decay)
        self.curvature_every = check_interval("curvature_every", curvature_every)
        self.inverse_every = check_interval("inverse_every", inverse_every)
        if not (isinstance(powell, float) and 0 < powell < 1):
            raise ValueError(f"powell must be a float in (0, 1), got {powell!r}")
        self.powell = powell
        self.secant = check_choice("secant", secant, ("consecutive", "same_batch"))
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        super().__init__(model, defaults, kl_clip=kl_clip, grad_scaler=grad_scaler, params=params)
        self._reset_curvature()

    def _reset_curvature(self) -> None:
        self.A: dict[int, Tensor] = {}       # [g, f+b, f+b] running
        self.HA: dict[int, Tensor] = {}      # (A + √λ I)⁻¹
        self.HG: dict[int, Tensor] = {}      # [g, o, o]
        self._HA_damping: Optional[Damping] = None
        self._prev: dict[int, tuple[Tensor, Tensor]] = {}  # (h̄, ḡ) of the last capture
        self._pending: dict[int, tuple[Tensor, Tensor]] = {}  # same_batch: before the step
        self.pairs = 0  # BFGS updates done (all layers)

    def _needs_capture(self, step: int) -> bool:
        return step % self.curvature_every == 0 or len(self.A) < len(self.blocks)

    def _means(self, blocks: dict[int, Block]) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """``{i: (A, h̄ [g, o], ḡ [g, o])}`` of the captured batch at the current weights."""
        out = {}
        for i, b in blocks.items():
            st = layer_stats(b)
            hbar = torch.einsum("gof,gf->go", b.weight_matrix().to(st.abar.dtype), st.abar)
            if not all(bool(torch.isfinite(t).all()) for t in (st.A, hbar, st.gbar)):
                raise SkipStep(f"non-finite K-BFGS statistics in layer '{b.layer.name}'")
            out[i] = (st.A, hbar, st.gbar)
        return out

    def _bfgs(self, i: int, b: Block, s: Tensor, y: Tensor, lm: float) -> None:
        H = self.HG.get(i)
        if H is None:
            H = torch.eye(b.o, dtype=s.dtype, device=s.device).expand(b.g, b.o, b.o).clone()
        Hn, _, _ = damped_bfgs_update(H, s, y, self.powell, lm)
        if bool(torch.isfinite(Hn).all()):
            self.HG[i] = Hn
            self.pairs += 1

    def _update_curvature(self, step: int, captured: bool) -> None:
        damping = self._damping()
        lms = [d ** 0.5 for d in self._block_dampings(damping)]  # √λ per block
        if captured:
            live_b = self._live_blocks()
            live = {i: b for i, b in enumerate(self.blocks) if b in live_b}
            means = self._means(live)
            for i, (A, hbar, gbar) in means.items():
                self.A[i] = running(self.A.get(i), A, self.stat_decay)
                b = self.blocks[i]
                if i not in self.HG:
                    self.HG[i] = torch.eye(b.o, dtype=A.dtype, device=A.device).expand(b.g, b.o, b.o).clone()
                if self.secant == "consecutive":
                    if i in self._prev:
                        ph, pg = self._prev[i]
                        self._bfgs(i, b, hbar - ph, gbar - pg, lms[i])
                    self._prev[i] = (hbar, gbar)
                else:
                    self._pending[i] = (hbar, gbar)
        if step % self.inverse_every == 0 or damping != self._HA_damping or len(self.HA) < len(self.A):
            for i, A in self.A.items():
                eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
                L, info = torch.linalg.cholesky_ex(A + lms[i] * eye)
                if bool((info != 0).any()):
                    raise SkipStep(f"K-BFGS: A + √λI not positive definite in layer '{self.blocks[i].layer.name}'")
                self.HA[i] = torch.cholesky_inverse(L)
            self._HA_damping = damping

    def _precondition(self, damping: Damping) -> dict[torch.nn.Parameter, Tensor]:
        out: dict[torch.nn.Parameter, Tensor] = {}
        for i, b in enumerate(self.blocks):
            if i not in self.HA or any(p.grad is None for p in b.params):
                continue
            HA, HG = self.HA[i], self.HG[i]
            out.update(b.split(HG @ b.grad_matrix().to(HA.dtype) @ HA))
        return out

    # ------------------------------------------------------------------ same-batch pairs
    def _before_step(self, closure: Optional[Callable[[], Tensor]]) -> None:
        if self.secant == "same_batch" and closure is None and self._needs_capture(self._sched):
            raise RuntimeError("KBFGS(secant='same_batch'): pass step(closure) — the closure is "
                               "re-run on the same batch after the update to form the BFGS pair")

    def _after_update(self, stats_step: bool, closure: Optional[Callable[[], Tensor]]) -> None:
        if self.secant != "same_batch" or not stats_step or closure is None or not self._pending:
            self._pending = {}
            return
        pending, self._pending = self._pending, {}
        with torch.enable_grad(), capturing(self.model, True):
            closure()
        self._seen_generation = self._info.store.generation
        self._info.store.finalize()  # float32 records (no GradScaler here: it refuses closures)
        lms = [d ** 0.5 for d in self._block_dampings(self._damping())]
        try:
            means = self._means({i: self.blocks[i] for i in pending})
        except SkipStep:
            return  # no pair this time; parameters already moved
        for i, (_, hbar, gbar) in means.items():
            ph, pg = pending[i]
            self._bfgs(i, self.blocks[i], hbar - ph, gbar - pg, lms[i])
