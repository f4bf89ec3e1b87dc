"""Measuring a step without a profiler, from the ops it dispatches (any device):

* :mod:`.dispatch` — :class:`~.dispatch.SyncCounter` (host syncs) and
  :class:`~.dispatch.OpCounter` (aten ops, kernel-launching ones apart);
* :mod:`.memory` — :class:`~.memory.LiveBytes` (live tensor bytes op by op),
  :func:`~.memory.tensor_bytes`, :func:`~.memory.kept_tensors`.
"""
from .dispatch import OpCounter, SyncCounter
from .memory import LiveBytes, kept_tensors, tensor_bytes

__all__ = ["SyncCounter", "OpCounter", "LiveBytes", "kept_tensors", "tensor_bytes"]
