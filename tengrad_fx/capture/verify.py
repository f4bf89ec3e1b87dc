"""prepare()'s probes on ``example_inputs``: does each covered call's input index samples?

The prepared model runs at batch sizes 2 and 3 (no grad, buffers restored). A call whose
input's leading dim is the batch at both is per sample. A row-wise layer's call whose is
not may still see a folded batch (:mod:`.fold`): its rows are then regrouped per sample
at run time (:mod:`.folded_rows`). Any other call's layer falls back, with the shapes seen.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn as nn

from . import ops
from .fold import FOLDABLE, find_folds, fold_keep
from .info import PrepareInfo
from .inputs import resize_batch, run_call, tensor_leaves
from .folded_rows import FOLDS
from .sharing import drop_layer

__all__ = ["verify_samples", "drop_weights_used_uncalled", "cuda_devices", "kept_buffers"]


def verify_samples(prepared: nn.Module, info: PrepareInfo, example_inputs: Sequence[Any]) -> None:
    """Run at batch 2 and 3 (no grad, buffers restored); drop layers whose input isn't per
    sample. ``example_inputs``: ``[args, kwargs]`` (:func:`.inputs.as_call`)."""
    with kept_buffers(prepared) as kept:
        shapes, folds = _probe_shapes(prepared, info, example_inputs, kept)
    _drop_unbatched(info, shapes, folds)


def _probe_shapes(prepared: nn.Module, info: PrepareInfo, example_inputs: Sequence[Any], kept: "kept_buffers",
                  ) -> tuple[dict[int, dict[tuple[int, int], tuple[int, ...]]], dict[int, Any]]:
    """The capture sites' input shapes at batch 2 and 3, and the folds found for row-wise
    layers whose leading dim is not the batch."""
    was_training = prepared.training
    modes = (True, False) if info.method == "fx-dual" else (was_training,)
    try:
        shapes, outs = _probe(prepared, example_inputs, modes)
        shared = _shared_index_sites(info, shapes)
        if shared:  # retry with those indices broadcast to the batch (position ids)
            key, needed = info.store.key, ops.NEEDS_SAMPLES.get(info.store.key, False)
            ops.SHARED_INDEX_SITES[key], ops.NEEDS_SAMPLES[key] = frozenset(shared), True
            try:
                shapes_b, outs_b = _probe(prepared, example_inputs, modes)
            except Exception:
                shapes_b, outs_b = shapes, None
            if outs_b is not None and _same_outputs(outs, outs_b):
                shapes = shapes_b
            else:
                ops.SHARED_INDEX_SITES[key], ops.NEEDS_SAMPLES[key] = frozenset(), needed
    finally:
        prepared.train(was_training)
        kept.restore()
    key = info.store.key
    pending = {}  # row-wise layers' sites whose leading dim is not the batch: folded?
    for spec in info.layers:
        for site in spec.sites:
            s2, s3 = shapes[2].get((key, site)), shapes[3].get((key, site))
            if spec.kind in FOLDABLE and s2 is not None and s3 is not None and (s2[0] != 2 or s3[0] != 3):
                keep = fold_keep(spec)
                pending[site] = (keep, math.prod(s2[:len(s2) - keep]))
    folds = find_folds(prepared, example_inputs, modes, key, pending) if pending else {}
    return shapes, folds


def _drop_unbatched(info: PrepareInfo, shapes: dict[int, dict[tuple[int, int], tuple[int, ...]]],
                    folds: dict[int, Any]) -> None:
    """Drop the layers whose input does not index samples (and is not a fold); note the folds."""
    key = info.store.key
    for spec in info.layers:
        bad = []
        spec.input_shapes = []
        for site in spec.sites:
            s2, s3 = shapes[2].get((key, site)), shapes[3].get((key, site))
            if s2 is None or s3 is None:
                continue  # not executed in this mode: nothing captured there either
            fold = folds.get(site)
            if isinstance(fold, tuple):
                keep = fold_keep(spec)
                s2 = (2, fold[0] * fold[1], *s2[len(s2) - keep:])  # the rows regrouped per sample
            elif s2[0] != 2 or s3[0] != 3:
                bad.append(f"leading dim {s2[0]} at batch 2 and {s3[0]} at batch 3" + (f"; {fold}" if fold else ""))
            spec.input_shapes.append(s2)
        if bad:
            drop_layer({spec.name: spec}, spec.name,
                        f"input does not index samples ({bad[0]})")
        else:
            mine = {(key, s): f for s, f in folds.items() if s in spec.sites and isinstance(f, tuple)}
            if mine:  # the forward notes its batch size: the rows per sample at other lengths
                FOLDS.update(mine)
                ops.NEEDS_SAMPLES[key] = True


def _probe(prepared: nn.Module, example_inputs: Sequence[Any], modes: tuple[bool, ...],
           ) -> tuple[dict[int, dict[tuple[int, int], tuple[int, ...]]], list[Any]]:
    """Each capture site's input shape at batch 2 and 3 (``{n: {(key, site): shape}}``),
    and the outputs at batch 3 (one per mode)."""
    shapes: dict[int, dict[tuple[int, int], tuple[int, ...]]] = {}
    outs = []
    n = 2
    try:
        for n in (2, 3):
            ops.PROBE = {}
            with torch.no_grad(), torch.random.fork_rng(devices=cuda_devices(prepared)):
                torch.manual_seed(0)  # dropout draws the same masks on every probe
                for mode in modes:
                    prepared.train(mode)
                    out = run_call(prepared, resize_batch(example_inputs, n))
                    if n == 3:
                        outs.append(out)
            shapes[n] = ops.PROBE
    except Exception as exc:
        raise RuntimeError(
            f"tengrad_fx.prepare: the prepared model failed on example_inputs at batch {n}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        ops.PROBE = None
    return shapes, outs


def _shared_index_sites(info: PrepareInfo, shapes: dict[int, dict[tuple[int, int], tuple[int, ...]]]) -> set[int]:
    """Embedding sites whose indices have leading dim 1 at batch 2 and 3 (shared by all samples)."""
    key = info.store.key
    return {site for spec in info.layers if spec.kind == "embedding" for site in spec.sites
            if shapes[2].get((key, site), (0,))[:1] == (1,) and shapes[3].get((key, site), (0,))[:1] == (1,)}


def _same_outputs(a: Any, b: Any) -> bool:
    """Do two output trees hold tensors of the same shapes and values (up to rounding)?"""
    la, lb = tensor_leaves(a), tensor_leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and (not x.is_floating_point() or torch.allclose(x, y, rtol=1e-5, atol=1e-7))
        and (x.is_floating_point() or torch.equal(x, y)) for x, y in zip(la, lb))


class kept_buffers:
    """Context manager: the buffers of ``model`` as on entry (running statistics, caches),
    put back by :meth:`restore` and on exit; for probes that must leave no trace."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.saved: dict[str, torch.Tensor] = {}

    def __enter__(self) -> "kept_buffers":
        self.saved = {n: b.detach().clone() for n, b in self.model.named_buffers()}
        return self

    def restore(self) -> None:
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                if name in self.saved:
                    b.copy_(self.saved[name])

    def __exit__(self, *exc: object) -> None:
        self.restore()


def cuda_devices(prepared: nn.Module) -> list[int]:
    """The CUDA devices the model's tensors are on (their RNG is forked by the probe)."""
    return sorted({t.device.index or 0 for t in prepared.parameters() if t.is_cuda})


# layer kinds whose capture op records its input's shape at every call (verify_samples)
_CALLED_KINDS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                           "conv_transpose3d"})


def drop_weights_used_uncalled(prepared: nn.Module, info: PrepareInfo, example_inputs: Sequence[Any]) -> None:
    """Module surgery: a layer never called on ``example_inputs`` whose weight still gets a
    gradient there is used without its module (a state-space mixer passes its convolution's
    weight to a kernel): it falls back. A layer on a branch these inputs do not take gets no
    gradient and stays covered. One forward and backward with capture off (buffers restored)."""
    tied = {id(s) for spec in info.layers for s in (spec, *spec.tied_lookups) if spec.tied_lookups}
    kinds = [spec.kind in _CALLED_KINDS or spec.kind == "embedding" and id(spec) not in tied for spec in info.layers]
    unseen = [spec for spec, called in zip(info.layers, kinds) if called and spec.sites and not spec.input_shapes
              and not spec.in_leaf and spec.weight.requires_grad]
    if info.method != "surgery" or not unseen:
        return
    key = info.store.key
    enabled = ops.ENABLED.get(key, False)
    ops.ENABLED[key] = False
    try:
        with torch.enable_grad(), kept_buffers(prepared):
            outs = [t for t in tensor_leaves(run_call(prepared, list(example_inputs)))
                    if t.is_floating_point() and t.requires_grad]
            total = sum((t.float().sum() for t in outs), torch.zeros(()))
            grads = torch.autograd.grad(total, [spec.weight for spec in unseen], allow_unused=True) \
                if outs else [None] * len(unseen)
    finally:
        ops.ENABLED[key] = enabled
    for spec, grad in zip(unseen, grads):
        if grad is not None:
            drop_layer({spec.name: spec}, spec.name, "weight used without calling the module on example_inputs "
                       "(e.g. passed to a fused kernel): its inputs cannot be recorded")
