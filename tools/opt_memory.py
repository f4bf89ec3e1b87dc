"""What an optimizer keeps in memory on this process between steps, in bytes.

* :func:`state_bytes`: the per-parameter optimizer state, every tensor of ``opt.state[p]``
  for every parameter ``p`` of its param groups (momentum buffers, any parameter-shaped
  buffer); a DTensor counts its local shard (``to_local()``).
* :func:`curvature_bytes`: TENGraD's curvature after a step: the cache's Grams ``K
  [L, m, m]``, factors ``chol [L, m, m]``, flags and per-layer dampings; every cached
  :class:`~tengrad_fx.optim.tengrad.layer_groups.LayerGroup`'s stacks (``Pw``, ``Pb``;
  ``A``, ``B``; a row group's ``K``) and factors; a distributed strategy's own records
  (``gram-blocks`` layers' local records and groups, an FSDP rank's row cuts ``(I', G')``);
  and the capture store's records (``I``, ``G``, ``P``, ``Gsum``) and un-merged
  micro-batch parts (``tengrad_fx.get_info(model).store``).
* :func:`param_bytes`: the model's whole (unsharded) parameters.

Tensors are counted once per storage (by its ``data_ptr``), at the storage's size: a
record that is a view of a group's stack adds nothing beyond the stack, and a view keeps
its whole storage alive. Parameter storages are never counted as curvature.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

import tengrad_fx
from tengrad_fx.capture.store import Record
from tengrad_fx.distributed.fsdp_rows import RowRecords, TransposedRows
from tengrad_fx.optim.tengrad.layer_groups import LayerGroup

__all__ = ["curvature_bytes", "param_bytes", "state_bytes", "storage_bytes"]

_GROUP_SKIP = frozenset({"layers", "_pairs"})  # a group's layers and its (weight, bias): parameters


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def tensors_in(obj: Any) -> Iterator[Tensor]:
    """The tensors ``obj`` holds: itself, the items of a list / tuple / dict (values), a
    :class:`Record`'s ``I, G, P, Gsum``, a :class:`RowRecords`' parts (a :class:`TransposedRows`' too), a
    :class:`LayerGroup`'s tensor attributes (not its layers or parameters)."""
    if obj is None:
        return
    if isinstance(obj, Tensor):
        yield _local(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)
    elif isinstance(obj, Record):
        yield from tensors_in((obj.I, obj.G, obj.P, obj.Gsum))
    elif isinstance(obj, RowRecords):
        yield from tensors_in(obj.parts)
    elif isinstance(obj, TransposedRows):
        yield from tensors_in([obj.weight, obj.db])
    elif isinstance(obj, LayerGroup):
        yield from tensors_in([v for k, v in vars(obj).items() if k not in _GROUP_SKIP])


def storage_bytes(ts: Iterator[Tensor], skip: frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages of ``ts`` (by ``data_ptr``; those in ``skip`` left out)."""
    seen: dict[int, int] = {}
    for t in ts:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in skip:
            seen[ptr] = s.nbytes()
    return sum(seen.values())


def _params(opt: torch.optim.Optimizer) -> list[Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of this rank's per-parameter state of ``opt`` (module docstring)."""
    return storage_bytes(t for p in _params(opt) for t in tensors_in(list(opt.state.get(p, {}).values())))


def param_bytes(model: torch.nn.Module) -> int:
    """``Σ numel·element_size`` over ``model``'s parameters, unsharded (a DTensor's global shape)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def curvature_bytes(opt: Any, model: Optional[torch.nn.Module]) -> int:
    """Bytes of the curvature ``opt`` (a TENGraD) keeps on this rank after a step, with the
    capture store of the prepared ``model`` (module docstring); 0 for another optimizer."""
    cache = getattr(opt, "curvature", None)
    if cache is None or model is None:
        return 0
    strategy = getattr(opt, "distribution", None)
    own = [getattr(strategy, name, None) for name in ("_local", "_local_groups", "_rows", "_row_parts")]
    store = tengrad_fx.get_info(model).store
    held = [cache.K, cache.chol, cache.ok, cache.alphas, cache.groups, own, store.records, store.parts]
    skip = frozenset(_local(p).untyped_storage().data_ptr() for p in _params(opt))
    return storage_bytes(tensors_in(held), skip)
