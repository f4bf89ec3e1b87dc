"""MC ("true") Fisher: sampled targets and one backward that records ``G`` only."""
from __future__ import annotations

import hashlib
import warnings
import weakref
from typing import Callable, Literal, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...capture.scored import fits
from ...capture.store import CaptureStore

__all__ = ["MCState", "SampleRNG", "check_mask", "inverse_cdf", "masked_sum_loss", "mc_capture", "part_of_global",
           "sample_targets", "sampled_loss", "scored_mask", "second_backward", "warn_unmasked"]


def second_backward(loss: Tensor, inputs: Sequence[Tensor]) -> None:
    """``torch.autograd.grad(loss, inputs, retain_graph=True)``, with a clear error where a
    compiled backward refuses to keep its graph (:func:`tengrad_fx._compile.keep_saved_tensors`)."""
    try:
        torch.autograd.grad(loss, inputs, retain_graph=True, allow_unused=True)
    except RuntimeError as exc:
        if "donated buffer" not in str(exc):
            raise
        raise RuntimeError(
            "tengrad_fx: the MC/Gauss-Newton Fisher backpropagates twice through the model, which this "
            "torch.compile-d backward refuses (its saved tensors are donated). tengrad_fx.prepare() turns "
            "donation off; leave torch._functorch.config.donated_buffer False when compiling a prepared model."
        ) from exc


class MCState:
    """Whether the sampled backward of the current micro-batch has run (``done``), and the
    optimizer it belongs to (``owner``, a weak reference). One object, shared by the
    optimizer and any copy of its ``__dict__`` (Lightning's ``LightningOptimizer`` is such a
    copy): a copy's ``mc_capture`` is handed to the owner, and the flag the step reads is
    the same. The flag lives in the owner's capture store (``CaptureStore.sampled``): the
    next capturing forward (a new micro-batch under gradient accumulation) clears it, so
    each micro-batch runs its own sampled backward."""

    def __init__(self, owner: object):
        self.owner = weakref.ref(owner)
        info = getattr(owner, "_info", None)
        self._store: Optional[CaptureStore] = getattr(info, "store", None)
        self._done = False
        self.warned_unmasked = False  # the warning of sequence logits sampled at every position was given

    @property
    def done(self) -> bool:
        return self._store.sampled if self._store is not None else self._done

    @done.setter
    def done(self, value: bool) -> None:
        if self._store is not None:
            self._store.sampled = value
        else:
            self._done = value


class SampleRNG:
    """The generator an optimizer draws its MC labels from: seeded from one draw of the
    global CPU RNG when first needed (``torch.manual_seed`` before training fixes it), then
    advanced by the sampling alone, so the labels do not depend on what else draws from the
    global RNG. Its state (:meth:`state`, a CPU ``uint8`` tensor) goes into the optimizer's
    ``state_dict``: a resumed run draws the labels an uninterrupted one draws."""

    def __init__(self) -> None:
        self._gen: Optional[torch.Generator] = None
        self._saved: Optional[Tensor] = None  # loaded, applied on first use (the device is known then)

    def get(self, device: torch.device) -> torch.Generator:
        """The generator, on ``device`` (that of the outputs sampled from)."""
        if self._gen is None or self._gen.device.type != device.type:
            saved = self._saved if self._gen is None else self._gen.get_state()
            self._saved = None
            self._gen = torch.Generator(device=device)
            if saved is None:
                self._gen.manual_seed(int(torch.randint(0, 2**62, (), dtype=torch.int64)))
            else:
                try:
                    self._gen.set_state(saved)
                except RuntimeError:  # another device type's state: a seed derived from it
                    digest = hashlib.sha256(saved.numpy().tobytes()).digest()
                    self._gen.manual_seed(int.from_bytes(digest[:8], "little") % 2**62)
        return self._gen

    def state(self) -> Optional[Tensor]:
        """The generator's state (None before the first draw, or the state loaded and not used yet)."""
        return self._gen.get_state() if self._gen is not None else self._saved

    def seed(self, seed: int) -> None:
        """Draw from ``torch.Generator().manual_seed(seed)``'s state on (that of the global
        RNG after ``torch.manual_seed(seed)``)."""
        self.load(torch.Generator().manual_seed(seed).get_state())

    def load(self, state: Optional[Tensor]) -> None:
        """Draw from ``state`` on (None: seed from the global RNG when first needed)."""
        self._gen = None
        self._saved = None if state is None else state.detach().to("cpu", torch.uint8).clone()


def check_mask(outputs: Tensor, mask: Optional[Tensor], mc_loss: str) -> Optional[Tensor]:
    """``mask`` as a bool tensor ``[m, *]`` of the positions of ``outputs`` (``[m, *, c]``)
    that count (True), or None; raises ``ValueError`` for a shape that does not fit."""
    if mask is None:
        return None
    lead = outputs.shape[:-1] if mc_loss == "cross_entropy" else outputs.shape[:mask.dim()]
    if tuple(mask.shape) != tuple(lead):
        raise ValueError(f"mc_capture: mask of shape {tuple(mask.shape)} does not fit outputs of shape "
                         f"{tuple(outputs.shape)} (expected {tuple(lead)}: one entry per sampled position)")
    return mask.to(device=outputs.device, dtype=torch.bool)


def scored_mask(store: CaptureStore, outputs: Tensor, mask: Optional[Tensor], mc_loss: str) -> Optional[Tensor]:
    """The positions the sampled loss takes: ``mask`` where given (:func:`check_mask`), else
    the positions the prepared model's call showed its loss scores (``store.scored``,
    :mod:`tengrad_fx.capture.scored`) where they fit ``outputs`` (cross-entropy), else None.
    The result stays in ``store.scored`` (cross-entropy; else None): position rows and the
    union of accumulated micro-batches read what the sampled loss used."""
    if mask is None and mc_loss == "cross_entropy" and fits(store.scored, outputs.shape[:-1]):
        mask = store.scored
    else:
        mask = check_mask(outputs, mask, mc_loss)
    store.scored = mask if mc_loss == "cross_entropy" else None
    return mask


def warn_unmasked(opt: object, state: MCState, outputs: Tensor, mask: Optional[Tensor], mc_loss: str) -> None:
    """Once per optimizer ``opt``: sequence logits ``outputs`` (``[B, L, V]``) sampled at every
    position, no mask having been found (``state.warned_unmasked`` remembers)."""
    if mask is not None or outputs.dim() < 3 or mc_loss != "cross_entropy" or state.warned_unmasked:
        return
    state.warned_unmasked = True
    warnings.warn(f"{type(opt).__name__}: the MC Fisher samples labels at every position of the sequence "
                  f"logits {tuple(outputs.shape)}: no labels= or attention_mask= reached the prepared model. "
                  "If the batch has padding or unscored positions, call opt.mc_capture(logits, mask=...) "
                  "before loss.backward() (mask: bool [B, L], True where the loss scores a position).",
                  UserWarning, stacklevel=4)


def part_of_global(shape: Sequence[int], part: int, parts: int, draw: Callable[[tuple[int, ...]], Tensor]) -> Tensor:
    """Part ``part`` of ``parts`` of one draw for a global batch: ``draw(global_shape)`` sliced to
    samples ``[part·m, (part+1)·m)``, ``shape = [m, *]`` the local batch's and ``global_shape =
    [parts·m, *]`` (the parts' equal batches concatenated in order). ``draw`` consumes its
    generator by the global shape alone, so every part advances it alike and a draw's entry
    depends only on the generator's state and its global index: one process (``parts=1``)
    draws what ``parts`` processes with the same generator state draw together."""
    shape = tuple(shape)
    if parts == 1:
        return draw(shape)
    if not shape:
        raise ValueError("mc_capture: outputs need a leading batch dimension to be split over processes")
    m = shape[0]
    return draw((parts * m, *shape[1:]))[part * m:part * m + m]


def inverse_cdf(logits: Tensor, u: Tensor, keep: Optional[Tensor] = None) -> Tensor:
    """Class indices ``[*]`` drawn from ``softmax(logits)`` (``[*, c]``) by inverse CDF: the
    first class whose cumulative weight exceeds ``u·total`` (``u`` ``[*]`` uniform in
    ``[0, 1)``, float32 or wider); a class of zero probability is never drawn. Rows where
    ``keep`` (bool ``[*]``) is False, or whose probabilities are not finite, take the uniform
    class ``⌊u·c⌋`` (their logits do not count). One ``[*, c]`` buffer (the unnormalized
    ``exp(logits − max)``, then its cumulative sum in place) and two ``searchsorted`` per
    row: no data-dependent shape, no host sync."""
    c = logits.shape[-1]
    w = logits.detach().to(u.dtype)
    cdf = (w - w.amax(-1, keepdim=True)).exp_().cumsum_(-1).reshape(-1, c)
    total = cdf[:, -1:].contiguous()  # finite where every weight of the row is (each is in [0, 1] or NaN)
    flat = u.reshape(-1, 1)
    drawn = torch.searchsorted(cdf, flat * total, right=True)
    last = torch.searchsorted(cdf, total)  # the last class of positive weight: u·total rounded up to total
    ok = total.isfinite() if keep is None else total.isfinite() & keep.reshape(-1, 1)
    uniform = (flat * c).long().clamp_(max=c - 1)
    return torch.where(ok, torch.minimum(drawn, last), uniform).reshape(u.shape)


@torch.no_grad()
def sample_targets(outputs: Tensor, mc_loss: Literal["cross_entropy", "mse"],
                   generator: Optional[torch.Generator] = None, mask: Optional[Tensor] = None,
                   part: int = 0, parts: int = 1) -> Tensor:
    """Targets sampled from the model's prediction: ``[m, *]`` class indices from the
    softmax of ``outputs`` (``[m, *, classes]`` logits) for ``cross_entropy``, or
    ``outputs + N(0, 1)`` for ``mse``; ``generator``: None for the global RNG.

    ``outputs`` is part ``part`` of ``parts`` equal batches of a global batch (rank order;
    :func:`part_of_global`): the uniforms (cross-entropy, one per position, drawn in the
    precision of the logits, at least float32) and the noise (mse) are drawn for the global
    batch and this part's slice is used, so ``parts`` processes whose generators share a
    state draw together the labels one process draws for the concatenated batch, and each
    advances its generator alike. A position's label depends only on the generator's
    state, its global index and its own logits (:func:`inverse_cdf`).
    ``mask`` (bool ``[m, *]``, cross-entropy): the positions where it is False are left out
    of the sample: their label is ``-100`` (``F.cross_entropy``'s ``ignore_index``) and
    their logits do not count; the labels of the kept positions are those of the unmasked
    draw. Rows with non-finite logits are drawn uniformly (their loss stays non-finite: the
    optimizers skip such a step on the device)."""
    if mc_loss == "cross_entropy":
        dtype = torch.promote_types(outputs.dtype, torch.float32)
        u = part_of_global(outputs.shape[:-1], part, parts, lambda shape: torch.rand(
            shape, dtype=dtype, device=outputs.device, generator=generator))
        target = inverse_cdf(outputs, u, mask)
        return target if mask is None else target.masked_fill(~mask, -100)
    noise = part_of_global(outputs.shape, part, parts, lambda shape: torch.randn(
        shape, dtype=outputs.dtype, device=outputs.device, generator=generator))
    return outputs.detach() + noise


def sampled_loss(outputs: Tensor, target: Tensor, mc_loss: Literal["cross_entropy", "mse"],
                 mask: Optional[Tensor] = None) -> Tensor:
    """The loss of the sampled ``target``: cross-entropy, the mean over the positions
    whose label is not ``-100`` (all, without a mask); MSE ``½‖out − t‖²`` summed over the
    outputs (those where ``mask``, bool ``[m, *]``, is True), mean over the batch ``m``."""
    if mc_loss == "cross_entropy":
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), target.reshape(-1))
    sq = (outputs - target).pow(2)
    if mask is not None:
        sq = torch.where(mask.reshape(*mask.shape, *([1] * (sq.dim() - mask.dim()))), sq, 0.0)
    return 0.5 * sq.reshape(outputs.shape[0], -1).sum(1).mean()


def masked_sum_loss(outputs: Tensor, target: Tensor) -> tuple[Tensor, Tensor]:
    """The cross-entropy of the sampled ``target`` (``[m, *]``, ``-100`` where masked) as
    ``2^-e · Σ ℓ`` over the ``N`` kept positions, ``2^e`` the power of two at or above ``N``;
    and the factor ``1/(N·2^-e)`` (float64, on the device) that makes it their mean.

    The records of its backward are multiplied by that factor afterwards (:meth:`CaptureStore.scale_own`),
    so they are those of the mean. Scaling by a power of two is exact, so a model that computes
    part of its backward in float32 (Llama's RMSNorm) rounds it the same way whatever ``N``:
    the micro-batches of an accumulated step give the rows of one batch to float64 rounding
    (:func:`tengrad_fx.capture.union.union` weights them by ``N_j/N``)."""
    n = (target != -100).sum(dtype=torch.float64).clamp(min=1)
    p = torch.exp2(-torch.ceil(torch.log2(n)))
    total = F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), target.reshape(-1), reduction="sum")
    return total * p.to(total.dtype), 1.0 / (n * p)


def mc_capture(store: CaptureStore, outputs: Tensor, mc_loss: Literal["cross_entropy", "mse"],
               weights: Sequence[Tensor], target: Optional[Tensor] = None,
               loss_scale: Optional[Tensor] = None, mask: Optional[Tensor] = None,
               generator: Optional[torch.Generator] = None) -> None:
    """Sample targets from ``outputs`` (:func:`sample_targets`; or use ``target``, e.g.
    labels sampled elsewhere), and backpropagate the sampled loss (:func:`sampled_loss`)
    through the graph with the store in G-only mode: the covered layers record ``G`` (and,
    where chosen, per-sample gradients) but compute no parameter gradients. Afterwards the
    store stops recording, so the real ``loss.backward()`` does not overwrite the MC ``G``
    (the next capturing forward, a new micro-batch, records again: ``CaptureStore.end_sampled``).
    ``loss_scale``: a GradScaler's scale, multiplied into the sampled loss so that these
    records carry the same scale as the training backward's (:mod:`.amp`).
    ``mask``: bool ``[m, *]`` (``outputs`` ``[m, *, c]``), the positions that count (e.g.
    ``attention_mask.bool()`` or ``labels != -100``); the others are not sampled and add
    nothing to the sampled loss (:func:`check_mask`; cross-entropy: :func:`masked_sum_loss`).
    ``generator``: the sampling's (None: the global RNG).
    """
    mask = check_mask(outputs, mask, mc_loss)
    if target is None:
        target = sample_targets(outputs, mc_loss, generator=generator, mask=mask)
    elif mask is not None and mc_loss == "cross_entropy":
        target = target.masked_fill(~mask, -100)
    mean: Optional[Tensor] = None
    if mask is not None and mc_loss == "cross_entropy":
        loss, mean = masked_sum_loss(outputs, target)
    else:
        loss = sampled_loss(outputs, target, mc_loss, mask)
    if loss_scale is not None:
        loss = loss * loss_scale
    store.grad_only = True
    try:
        second_backward(loss, weights)
    finally:
        store.grad_only = False
    if mean is not None:
        store.scale_own(mean)
    store.end_sampled()
