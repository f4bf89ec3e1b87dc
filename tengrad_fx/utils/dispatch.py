"""Machine-independent facts of a step: host syncs and aten ops, counted at dispatch.

* :class:`SyncCounter` counts the operations that make the host wait for the device:
  scalar reads (``aten._local_scalar_dense`` — ``.item()``, ``bool(t)``, ``float(t)`` —,
  ``is_nonzero``, ``equal``, ``Tensor.tolist``), the linalg error checks that read
  ``info`` on the host (``_linalg_check_errors``, ``torch.linalg.cholesky`` without
  ``_ex``, ``torch.linalg.eigh``, whose kernel checks inside), ops whose output shape
  depends on the data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
  ``repeat_interleave`` without a size), and
  blocking copies from a non-CPU device to the CPU. On a CPU-only machine nothing really
  waits, but every one of these WOULD wait on a GPU, so counting them on CPU tells.
* :class:`OpCounter` counts every aten op dispatched, and separately the ops that launch a
  kernel (everything but views/aliases, whose outputs share the input's memory).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["SyncCounter", "OpCounter", "SYNC_OPS"]

_aten = torch.ops.aten
SYNC_OPS = {
    _aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
    _aten._linalg_check_errors.default, _aten.nonzero.default, _aten.masked_select.default,
    _aten._unique2.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
    _aten.repeat_interleave.Tensor, _aten.allclose.default,
    _aten._linalg_eigh.default,  # its kernel reads the eigensolver's info on the host
}
_INDEX_OPS = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
              _aten._index_put_impl_.default}


def _bool_index(args: tuple[Any, ...]) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in idx)


def _device_to_cpu_copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func is _aten._to_copy.default:
        src, dev = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.device.type != "cpu" and dev is not None \
            and torch.device(dev).type == "cpu" and not kwargs.get("non_blocking", False)
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return dst.device.type == "cpu" and src.device.type != "cpu" and (blocking or not dst.is_pinned())
    return False


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as sc: ...``; ``sc.count`` and ``sc.ops`` (a Counter of names)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self._tolist = torch.Tensor.tolist

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def __enter__(self) -> "SyncCounter":
        counter = self
        real = self._tolist

        def tolist(t: torch.Tensor) -> Any:  # reads every element on the host
            counter.ops["Tensor.tolist"] += 1
            return real(t)

        torch.Tensor.tolist = tolist  # type: ignore[assignment, method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in SYNC_OPS or (func in _INDEX_OPS and _bool_index(args)) \
                or _device_to_cpu_copy(func, args, kwargs):
            self.ops[str(func)] += 1
        return func(*args, **kwargs)


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as oc: ...``; ``oc.total`` (all aten ops), ``oc.kernels`` (non-view
    ops: the ones that launch work on a device) and ``oc.ops`` (a Counter by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.total = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.total += 1
        if not func.is_view and func not in (_aten.detach.default, _aten.lift_fresh.default):
            self.kernels += 1
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))
