"""prepare()'s fold probe: is a call site's input a folded batch (see :mod:`.folded_rows`)?

For a covered row-wise layer (:data:`FOLDABLE`) whose input's leading dim is not the
batch, the model is run at batch 3 on ``example_inputs``' first sample repeated, then
three more times with one sample perturbed (its floating-point inputs; with none, such as
token ids alone, its integer inputs shifted among the values they hold). Dropout and batch statistics are switched off
for these runs (every submodule in eval mode, one RNG seed for all runs), so a row of the
layer input changes only if it depends on the perturbed sample. The rows are laid out as
``[A, m, C]`` when perturbing sample ``i`` changes rows among ``{a·3C + i·C + c}`` only,
for every ``i``, with exactly one such ``(A, C)`` (``A·2·C`` rows at batch 2); then
``(A, C)`` is the site's fold. Otherwise the reason is returned. The fold is probed at
``example_inputs``' length; :func:`.folded_rows.layout_at` maps it to other lengths.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import torch
import torch.nn as nn
from torch import Tensor

from . import ops
from .inputs import map_tensors, resize_batch, run_call
from .norm import normalized_ndim

__all__ = ["FOLDABLE", "fold_keep", "find_folds"]

FOLDABLE = ("linear", "layernorm", "rmsnorm")


def fold_keep(spec: Any) -> int:
    """Trailing dims of the layer input that are not rows (the features)."""
    return 1 if spec.kind == "linear" else normalized_ndim(spec.module)


def _perturbed(inputs: Sequence[Any], i: int) -> tuple[list[Any], bool]:
    """``inputs`` (batch 3) with sample ``i`` of every floating tensor leaf changed; when
    there is none (token ids), sample ``i`` of every integer leaf instead (:func:`_shifted`)."""
    gen = torch.Generator().manual_seed(1234 + i)
    hit = [False]

    def change(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.shape[0] != 3 or not t.is_floating_point():
            return t
        t = t.clone()
        noise = torch.randn(t[i].shape, generator=gen, dtype=torch.float64)
        t[i] += (0.5 * noise).to(t.dtype).to(t.device)
        hit[0] = True
        return t

    def shift(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.shape[0] != 3 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            return t
        t, hit[0] = _shifted(t, i), True
        return t

    out = [map_tensors(change, x) for x in inputs]
    if not hit[0]:
        out = [map_tensors(shift, x) for x in inputs]
    return out, hit[0]


def _shifted(t: Tensor, i: int) -> Tensor:
    """Integer ``t [3, ...]`` with sample ``i``'s values moved one step cyclically within
    the values ``t`` holds, ``lo..hi`` (token ids stay valid ids; a constant leaf, such as an
    all-ones attention mask, is left as it is): ``v -> lo + (v - lo + 1) mod (hi - lo + 1)``."""
    lo, hi = int(t.min()), int(t.max())
    if lo == hi:
        return t
    t = t.clone()
    t[i] = lo + (t[i] - lo + 1) % (hi - lo + 1)
    return t


def _fold_of(runs: list[dict[tuple[int, int], Tensor]], k: tuple[int, int], keep: int,
             rows2: int) -> Union[tuple[int, int], str]:
    """The one ``[A, m, C]`` layout that holds every changed row of sample ``i`` in
    ``{a·3C + i·C + c}`` (rows left unchanged by a perturbation, e.g. zeroed by dropout,
    may be missing from a set, but each sample must change some row), or why not."""
    base = runs[0][k]
    feat = base.shape[base.dim() - keep:].numel()
    T = base.numel() // max(1, feat)
    changed = []
    for i in range(3):
        x = runs[i + 1].get(k)
        if x is None or x.shape != base.shape:
            return "rows of a sample are not a fixed index set (the input shape depends on its values)"
        rows = (x.reshape(T, -1) != base.reshape(T, -1)).any(1).nonzero().flatten().cpu()
        if rows.numel() == 0:
            return f"rows of a sample are not a fixed index set (perturbing sample {i} changed no row)"
        changed.append(rows)
    fits = []
    for C in (c for c in range(1, T // 3 + 1) if T % (3 * c) == 0):
        A = T // (3 * C)
        if A * 2 * C == rows2 and all(bool(((r % (3 * C)) // C == i).all()) for i, r in enumerate(changed)):
            fits.append((A, C))
    if len(fits) == 1:
        return fits[0]
    counts = "/".join(str(r.numel()) for r in changed)
    if not fits:
        return (f"rows of a sample are not a fixed index set (perturbing samples 0/1/2 changed {counts} "
                f"of {T} rows, in no [A, m, C] layout)")
    return f"row layout of the folded batch is ambiguous ({fits} all fit the rows that changed)"


def _cuda_devices() -> list[int]:
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []


def find_folds(prepared: nn.Module, example_inputs: Sequence[Any], modes: Sequence[bool], key: int,
               pending: dict[int, tuple[int, int]]) -> dict[int, Union[tuple[int, int], str]]:
    """``site -> (A, C)`` or the reason it is not a folded batch, for ``pending``
    (``site -> (keep, rows at batch 2)``); ``example_inputs``: ``[args, kwargs]``
    (:func:`.inputs.as_call`). Buffers are the caller's to restore."""
    base = resize_batch(example_inputs, 3)
    subs = [(m, m.training) for m in prepared.modules() if m is not prepared]
    out: dict[int, Union[tuple[int, int], str]] = {}
    was = prepared.training
    try:
        for mode in modes:
            prepared.train(mode)
            for m, _ in subs:
                m.training = False  # samples independent: no batch statistics, no dropout
            runs = []
            for i in (None, 0, 1, 2):
                inputs, hit = (base, True) if i is None else _perturbed(base, i)
                if not hit:
                    return {s: "folded batch not probed: example_inputs have no floating-point tensor to perturb"
                            for s in pending}
                ops.PROBE, ops.PROBE_INPUTS = {}, {}
                with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices()):
                    torch.manual_seed(0)  # (CPU and CUDA generators; restored on exit)
                    run_call(prepared, inputs)
                runs.append(ops.PROBE_INPUTS)
            for site, (keep, rows2) in pending.items():
                if (key, site) in runs[0] and site not in out:
                    out[site] = _fold_of(runs, (key, site), keep, rows2)
    finally:
        ops.PROBE = ops.PROBE_INPUTS = None
        prepared.train(was)
        for m, t in subs:
            m.training = t
    return out
