"""Shared plumbing of the baseline optimizers (KFAC, EKFAC, KBFGS, NGD).

Everything here reads what :func:`tengrad_fx.prepare` captured (``I``, ``G`` per call of a
covered layer); nothing registers a hook.

Matrix form of a layer (``g`` groups, ``o = c_out/g`` outputs and ``f = c_in/g·Πk``
inputs per group, ``b = 1`` with a bias else ``0``): the gradient, and every update, is
``[g, o, f + b]`` — the weight ``[c_out, c_in/g, *k]`` as ``[g, o, f]`` with the bias
``[c_out]`` as an extra last column (the homogeneous coordinate ``ã = (a, 1)``).

Statistics of the captured batch (``m`` samples, ``S`` positions — output pixels of a
conv, tokens of a Linear on ``[m, *, d_in]``; several calls of one module add their
positions), with ``ğ = k·G`` the per-sample output gradients (``k = m`` for
``loss_reduction="mean"``, else 1):

* ``A = Σ_{i,s} ã ãᵀ / (m·S)``      ``[g, f+b, f+b]``  (mean over samples and positions)
* ``G = Σ_{i,s} ğ ğᵀ / m``          ``[g, o, o]``      (mean over samples, sum over positions)
* ``ā = Σ_{i,s} ã / (m·S)``         ``[g, f+b]``
* ``ḡ = Σ_{i,s} ğ / m``             ``[g, o]``
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal, Optional

import torch
from torch import Tensor

from ...capture.info import PrepareInfo, get_info
from ...capture.norm import NORM_KINDS
from ...capture.switch import capturing
from ..step.checks import check_choice, check_interval, check_nonneg, check_positive, check_unit
from ..step.mc import mc_capture
from ..step.param_groups import Damping, group_index, layer_damping, optimizer_params
from ..step.skeleton import SkipStep, StepSkeleton
from ..step.result import StepResult
from ...curvature.layer import KERNELS, CoveredLayer, covered_layers
from ...curvature.tensors import DEFAULT_BLOCK_BYTES

__all__ = ["Block", "Stats", "CurvatureOptimizer", "SkipStep", "layer_stats",
           "per_sample_grad_chunks", "check_positive", "check_nonneg", "check_interval",
           "check_unit", "check_choice", "check_float_dtype"]


# --------------------------------------------------------------------------- layer blocks
@dataclass(eq=False)
class Block:
    """One covered layer as a matrix-form block ``[g, o, f + b]``."""

    layer: CoveredLayer
    params: list[torch.nn.Parameter]  # [weight] or [weight, bias]
    g: int
    o: int
    f: int  # inputs per group, without the homogeneous coordinate

    @property
    def has_bias(self) -> bool:
        return len(self.params) == 2

    @property
    def fb(self) -> int:
        """``f + b``: rows/cols of the A factor."""
        return self.f + int(self.has_bias)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def transposed(self) -> bool:
        """A Linear whose weight is stored ``[d_in, d_out]`` (Hugging Face ``Conv1D``)."""
        return self.layer.kind == "linear" and self.layer.spec.transposed

    def matrix(self, w: Tensor, b: Optional[Tensor]) -> Tensor:
        """Weight-shaped ``w`` and bias-shaped ``b`` as ``[g, o, f + b]``."""
        mat = (w.t() if self.transposed else w).reshape(self.g, self.o, self.f)
        if self.has_bias:
            assert b is not None
            mat = torch.cat([mat, b.reshape(self.g, self.o, 1)], 2)
        return mat

    def grad_matrix(self) -> Tensor:
        """The parameters' ``.grad`` in matrix form."""
        w, *b = self.params
        return self.matrix(w.grad, b[0].grad if b else None)  # type: ignore[arg-type]

    def weight_matrix(self) -> Tensor:
        w, *b = self.params
        return self.matrix(w.detach(), b[0].detach() if b else None)

    def split(self, mat: Tensor) -> dict[torch.nn.Parameter, Tensor]:
        """Inverse of :meth:`matrix`: ``{param: tensor shaped like param}``."""
        w, *b = self.params
        mw = mat[..., : self.f]
        mw = mw.reshape(self.o, self.f).t() if self.transposed else mw.reshape(w.shape)
        out = {w: mw.to(w.dtype)}
        if b:
            out[b[0]] = mat[..., self.f].reshape(b[0].shape).to(b[0].dtype)
        return out


def make_blocks(layers: list[CoveredLayer], kronecker: bool = True,
                grouped: Optional[dict[Tensor, int]] = None) -> list[Block]:
    """Blocks of the layers with a trainable weight whose parameters are all in a param group
    (given ``grouped``; a bias-only layer, or the grouped parameters of another layer, get the
    fallback update: no block describes a bias alone). With ``kronecker`` (the
    K-FAC family), transposed convolutions are left out: their bias gradient sums the
    output gradient over OUTPUT pixels, so ``[g, o, f + b]`` with the bias as homogeneous
    column does not describe them; they get the fallback update (a warning says so)."""
    out = []
    skipped = []
    for layer in layers:
        params = layer.params
        if layer.bias_only or (grouped is not None and not all(p in grouped for p in params)):
            continue  # a bias alone has no Kronecker form: the fallback update
        if kronecker and layer.spec.transposed and layer.kind != "linear":
            skipped.append(layer.name)
            continue
        w = layer.weight
        if layer.kind in ("param", "embedding"):  # no Kronecker form here: plain gradient
            continue
        if layer.kind in NORM_KINDS:  # C groups of a 1-in, 1-out layer (curvature/norm.py)
            out.append(Block(layer, params, w.numel(), 1, 1))
            continue
        if layer.kind == "linear":  # weight [o, f], or [f, o] stored transposed
            o, f = (w.shape[1], w.shape[0]) if layer.spec.transposed else (w.shape[0], w.shape[1])
            out.append(Block(layer, params, 1, o, f))
            continue
        g = layer.spec.groups
        out.append(Block(layer, params, g, w.shape[0] // g, w[0].numel()))
    if skipped:
        warnings.warn(f"no Kronecker-factored curvature for transposed convolutions {skipped}: their "
                      "parameters get the SGD-momentum fallback update (TENGraD and NGD cover them)",
                      RuntimeWarning)
    return out


# --------------------------------------------------------------------------- statistics
@dataclass
class Stats:
    """Captured-batch statistics of one block (see module docstring)."""

    A: Tensor     # [g, f+b, f+b]
    G: Tensor     # [g, o, o]
    abar: Tensor  # [g, f+b]
    gbar: Tensor  # [g, o]
    m: int


def _chunks(block: Block, dtype: torch.dtype,
            extra: int = 0) -> Iterator[tuple[int, int, list[tuple[Tensor, Tensor]]]]:
    """``(i0, i1, [(Ã [c,g,S,f+b], Ğ [c,g,S,o]) per call])`` over sample chunks.

    ``Ã`` carries the homogeneous coordinate, ``Ğ = k·G`` the per-sample output grads.
    Chunks are sized so their ``Ã``, ``Ğ`` and ``extra`` numbers per sample (the caller's
    own per-sample work) stay near ``DEFAULT_BLOCK_BYTES`` (at least one sample).
    """
    layer = block.layer
    recs = layer.records()
    for r in recs:
        if r.I is None or r.G is None:
            raise RuntimeError(
                f"layer '{layer.name}': per-sample gradients were materialized in backward "
                "(store.jacobian_sites); this optimizer needs the captured I and G")
    m = recs[0].m
    k = float(m) if layer._info.loss_reduction == "mean" else 1.0
    kern = KERNELS[layer.kind]
    S_tot = sum(kern.dims(layer.spec, tuple(r.I.shape))[1] for r in recs)  # type: ignore[union-attr]
    per_sample = (S_tot * block.g * (block.fb + block.o) + extra) * torch.finfo(dtype).bits // 8
    c = max(1, min(m, DEFAULT_BLOCK_BYTES // max(1, per_sample)))
    for i0 in range(0, m, c):
        i1 = min(m, i0 + c)
        parts = []
        for r in recs:
            A, B = kern.layout(layer.spec, r.I[i0:i1].to(dtype), r.G[i0:i1].to(dtype))  # type: ignore[index]
            if block.has_bias:
                A = torch.cat([A, A.new_ones(*A.shape[:-1], 1)], -1)
            parts.append((A, B * k))
        yield i0, i1, parts


def layer_stats(block: Block, dtype: Optional[torch.dtype] = None) -> Stats:
    """``A, G, ā, ḡ`` of the captured batch (module docstring), in ``dtype``
    (default: the weight's)."""
    dtype = dtype or block.params[0].dtype
    g, fb, o = block.g, block.fb, block.o
    dev = block.params[0].device
    A = torch.zeros(g, fb, fb, dtype=dtype, device=dev)
    G = torch.zeros(g, o, o, dtype=dtype, device=dev)
    asum = torch.zeros(g, fb, dtype=dtype, device=dev)
    gsum = torch.zeros(g, o, dtype=dtype, device=dev)
    rows = 0
    m = 0
    for i0, i1, parts in _chunks(block, dtype):
        m = i1
        for Ã, Ğ in parts:
            a = Ã.transpose(0, 1).reshape(g, -1, fb)  # [g, c·S, f+b]
            b = Ğ.transpose(0, 1).reshape(g, -1, o)
            A.baddbmm_(a.transpose(1, 2), a)
            G.baddbmm_(b.transpose(1, 2), b)
            asum += a.sum(1)
            gsum += b.sum(1)
            if i0 == 0:
                rows += Ã.shape[2]  # positions per sample, over calls
    n_rows = m * rows
    return Stats(A / n_rows, G / m, asum / n_rows, gsum / m, m)


def per_sample_grad_chunks(block: Block, dtype: Optional[torch.dtype] = None) -> Iterator[Tensor]:
    """Per-sample gradients in matrix form, ``[c, g, o, f+b]`` per sample chunk:
    ``Σ_{calls, s} ğ ãᵀ`` (their mean over the batch is the mean-loss gradient)."""
    dtype = dtype or block.params[0].dtype
    for _, _, parts in _chunks(block, dtype, extra=3 * block.g * block.o * block.fb):
        out = None
        for Ã, Ğ in parts:
            d = torch.einsum("cgso,cgsf->cgof", Ğ, Ã)
            out = d if out is None else out + d
        assert out is not None
        yield out


# --------------------------------------------------------------------------- base optimizer
def check_float_dtype(name: str, v: Any) -> Optional[torch.dtype]:
    """``v``: a floating ``torch.dtype`` or ``None`` (ValueError naming ``name`` otherwise)."""
    if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
        raise ValueError(f"{name} must be a floating torch.dtype or None, got {v!r}")
    return v


class CurvatureOptimizer(StepSkeleton):
    """Common part of the baselines: param groups over the model's parameters
    (:mod:`tengrad_fx.optim.step.param_groups`; a layer's damping is its weight's group's), the
    shared step of :mod:`tengrad_fx.optim.step.skeleton` (host-read skips: a non-finite
    gradient or update skips the step before any statistic is updated).

    On statistics steps (:meth:`_needs_capture`) :meth:`_update_curvature`; then ``u`` per
    covered parameter from :meth:`_precondition` (``u = g`` for fallback parameters), the
    KL clip, weight decay and momentum. Capture is switched on only before steps that need
    statistics. Counters live in ``self.state[<method name>]``.

    Subclasses take ``(model, lr, damping, *, ...)``: every option after ``damping`` is
    keyword-only (:mod:`tengrad_fx.optim.step.renamed` keeps renamed options' old names).
    """

    NAME = "curvature"
    SUPPORTS_MC = True
    EMPTY_STEP_SKIPS = True
    KRONECKER = True  # blocks need the matrix form [g, o, f + b] (not NGD)
    CURVATURE: tuple[str, ...] = ()  # attributes saved in state_dict()["curvature"]

    def __init__(self, model: torch.nn.Module, defaults: dict[str, Any], *, kl_clip: Optional[float],
                 fisher: str = "empirical", mc_loss: Literal["cross_entropy", "mse"] = "cross_entropy",
                 grad_scaler: Any = None, params: Optional[Iterable[Any]] = None):
        info: PrepareInfo = get_info(model)  # ValueError for an unprepared model
        check_nonneg("lr", defaults["lr"])
        check_positive("damping", defaults["damping"])
        check_unit("momentum", defaults["momentum"])
        check_nonneg("weight_decay", defaults["weight_decay"])
        if kl_clip is not None:
            check_positive("kl_clip", kl_clip)
        check_choice("fisher", fisher, ("empirical", "mc") if self.SUPPORTS_MC else ("empirical",))
        check_choice("mc_loss", mc_loss, ("cross_entropy", "mse"))
        super().__init__(optimizer_params(model, params, type(self).__name__), defaults)
        self._init_skeleton(model, info, grad_scaler)
        self.kl_clip = kl_clip
        self.fisher = fisher
        self.mc_loss = mc_loss
        self.blocks = make_blocks(covered_layers(model), self.KRONECKER, group_index(self.param_groups))
        self._seen_generation = -1
        info.store.jacobian_sites = set()  # these optimizers read I and G
        self._watch_output()
        capturing(model, True)

    # ------------------------------------------------------------------ hooks for subclasses
    def _update_curvature(self, step: int, captured: bool) -> None:
        """Called every step before :meth:`_precondition`; ``captured``: this step's batch
        was captured (a statistics step). Raise :class:`SkipStep` before committing bad values."""
        raise NotImplementedError

    def _precondition(self, damping: Damping) -> dict[torch.nn.Parameter, Tensor]:
        raise NotImplementedError

    def _reset_curvature(self) -> None:
        raise NotImplementedError

    def _groups_changed(self) -> None:
        """Parameters were added: the blocks are rebuilt and the curvature restarts from
        the next step's capture (block indices change)."""
        self.blocks = make_blocks(covered_layers(self.model), self.KRONECKER, group_index(self.param_groups))
        self._reset_curvature()

    def _block_dampings(self, damping: Damping) -> list[float]:
        """Each block's damping: its weight's group's (one float: every block's)."""
        index = group_index(self.param_groups) if isinstance(damping, tuple) else None
        return [layer_damping(damping, b.params[0], index, b.layer.name) for b in self.blocks]

    # ------------------------------------------------------------------ skeleton hooks
    def _check_capture(self, stats_step: bool) -> None:
        store = self._info.store
        store.consume(self._info.loss_reduction)  # accumulated micro-batches: the union of their rows
        if stats_step:
            if store.generation == self._seen_generation:
                raise RuntimeError(f"{type(self).__name__}: step {self._sched} needs the captured I, G "
                                   "of this batch but nothing new was captured (capture switched off?)")
            self._seen_generation = store.generation

    def _updates(self, step: int, stats_step: bool, mc_step: bool, damping: Damping) -> StepResult:
        if stats_step:  # a gradient but no record (capture was off for it): u = g, counted
            self._add_uncaptured(sum(1 for b in self.blocks if self._has_grad(b) and not b.layer.captured))
        self._update_curvature(step, stats_step)
        return StepResult(self._precondition(damping))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ public
    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"curvature"``: copies of the running factors /
        inverses (attributes named in ``CURVATURE``), so a resumed run continues exactly."""
        sd = super().state_dict()
        sd["curvature"] = copy.deepcopy({k: getattr(self, k) for k in self.CURVATURE})
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load counters, momentum buffers and (when present) the curvature; without it the
        curvature is rebuilt from the next step's capture."""
        sd = dict(state_dict)
        curv = sd.pop("curvature", None)
        super().load_state_dict(sd)
        self._reset_curvature()
        if curv:
            dev = self.blocks[0].params[0].device if self.blocks else torch.device("cpu")
            for k, v in curv.items():
                if k in self.CURVATURE:
                    setattr(self, k, _to_device(copy.deepcopy(v), dev))
        capturing(self.model, self._needs_capture(self._sched))

    def _mc_backward(self, outputs: Tensor, targets: Optional[Tensor], mask: Optional[Tensor]) -> None:
        """:meth:`mc_capture`'s backward of sampled targets (records ``G`` only)."""
        mc_capture(self._info.store, outputs, self.mc_loss, [b.params[0] for b in self.blocks],
                   targets, self._loss_scale(), mask, self._mc_rng.get(outputs.device))

    def _live_blocks(self) -> list[Block]:
        """Blocks with a gradient and a record this step (a layer the forward did not call,
        or called with capture off, keeps its previous statistics; without any it gets
        ``u = g``)."""
        return [b for b in self.blocks if self._has_grad(b) and b.layer.captured]

    @staticmethod
    def _has_grad(b: Block) -> bool:
        return all(p.grad is not None for p in b.params)


def _to_device(v: Any, dev: torch.device) -> Any:
    if isinstance(v, Tensor):
        return v.to(dev)
    if isinstance(v, dict):
        return {k: _to_device(x, dev) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(_to_device(x, dev) for x in v)
    return v


def running(old: Optional[Tensor], new: Tensor, decay: float) -> Tensor:
    """``decay·old + (1 − decay)·new``; the first estimate initializes (``old is None``)."""
    return new if old is None else old * decay + new * (1.0 - decay)

