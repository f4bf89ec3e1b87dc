"""Machine-independent memory facts of a step: bytes kept and live tensor bytes at dispatch.

* :func:`tensor_bytes` — bytes of the unique storages under some tensors (views of one
  storage counted once), e.g. what an optimizer and its capture store keep between steps
  (:func:`kept_tensors`).
* :class:`LiveBytes` — ``with LiveBytes(start_tensors) as lb: opt.step()``: tracks, op by op,
  the bytes of the storages alive among ``start_tensors`` and every storage an aten op
  created inside the block (a weak reference each: a storage counts until it is freed);
  ``lb.peak - lb.start`` is the step's transient on top of what was alive before it. A
  second full copy of a stacked ``P`` (or of ``I, G``) shows up there as its bytes.

Both see tensors, not the allocator: on a GPU the caching allocator's rounding and
cuDNN workspaces come on top (``tools.bench --memory --device cuda`` measures those);
ops inside a custom op's kernel (the capture backward) are not seen, only its outputs.
"""
from __future__ import annotations

import ctypes
from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "kept_tensors", "steady_malloc", "tensor_bytes"]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the unique storages under ``tensors``."""
    seen: dict[StorageWeakRef, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[StorageWeakRef(s)] = s.nbytes()
    return sum(seen.values())


def kept_tensors(opt: Any) -> list[torch.Tensor]:
    """Every tensor a TENGraD optimizer keeps for later steps besides parameters, gradients
    and momentum: its layer groups' stacks, Grams, factors and the store's records."""
    out: list[torch.Tensor] = []
    cache = opt.curvature  # tengrad_fx.optim.tengrad.cache.CurvatureCache
    for grp in cache.groups:
        out += [t for t in (getattr(grp, n, None) for n in ("Pw", "Pb", "A", "B", "chol"))
                if isinstance(t, torch.Tensor)]
    out += [t for t in cache.K if isinstance(t, torch.Tensor)]
    out += [t for t in (cache.chol, cache.ok) if t is not None]
    store = opt._info.store
    for recs in store.records.values():
        for r in recs:
            out += [t for t in (r.I, r.G, r.P, r.Gsum) if t is not None]
    return out


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes op by op: ``start`` (alive on entry, from ``start_tensors``),
    ``peak`` (the most alive after any op), ``end`` (alive on exit)."""

    def __init__(self, start_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._live: dict[StorageWeakRef, int] = {}
        for t in start_tensors:
            self._add(t)
        self.start = self.peak = self.end = self._sweep()

    def _add(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.nbytes():
            self._live.setdefault(StorageWeakRef(s), s.nbytes())

    def _sweep(self) -> int:
        self._live = {k: v for k, v in self._live.items() if not k.expired()}
        return sum(self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self._sweep())
        return out

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.end = self._sweep()


def steady_malloc() -> bool:
    """Keep glibc's heap steady for the rest of the process (``mallopt``): every allocation
    from the heap (``M_MMAP_MAX = 0``: no fresh ``mmap``; glibc falls back to one only where
    the heap cannot grow), no trimming, 64 MiB of padding when it grows. Memory a CPU step
    frees is then reused by the next without page faults, as CUDA's caching allocator never
    gives memory back. True when applied (glibc), False elsewhere (nothing changed)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4  # <malloc.h>
    settings = ((m_mmap_max, 0), (m_trim_threshold, 2**30), (m_top_pad, 64 * 2**20))
    return all(mallopt(param, value) == 1 for param, value in settings)
