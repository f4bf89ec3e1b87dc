"""The classes module surgery swaps in, in one registry that :func:`.unprepare.unprepare` reads.

Module surgery changes a module's class in place to a subclass made here (a capturing
forward, a batched ``__getattr__``, ...), and keeps its state in ``module.__dict__`` under
names from :data:`ATTRS`. Undoing it walks the class back past every registered subclass
(a module may carry several) and removes those attributes.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["ATTRS", "swapped_class", "is_swapped", "restore_class"]

# attributes module surgery sets on a module's ``__dict__``
ATTRS = ("_tengrad_call", "_tengrad_added", "_tengrad_output_key", "_tengrad_lookup", "_tengrad_experts",
         "_tengrad_router", "_tengrad_replay")

_CLASSES: dict[tuple[str, type], type] = {}
_SWAPPED: set[type] = set()


def swapped_class(role: str, cls: type, namespace: dict[str, Any], bases: tuple[type, ...] = ()) -> type:
    """The subclass of ``cls`` (then ``bases``) with ``namespace`` that plays ``role``, made
    once per ``(role, cls)``; it keeps ``cls``'s name and module (reprs, pickles by name)."""
    made = _CLASSES.get((role, cls))
    if made is None:
        made = type(cls.__name__, (cls, *bases), {"__module__": cls.__module__, **namespace})
        _CLASSES[(role, cls)] = made
        _SWAPPED.add(made)
    return made


def is_swapped(cls: type) -> bool:
    """Was ``cls`` made by :func:`swapped_class`?"""
    return cls in _SWAPPED


def restore_class(mod: nn.Module) -> None:
    """Undo module surgery on ``mod``: its class back to the one it had before any swap,
    its surgery attributes removed."""
    cls = type(mod)
    while cls in _SWAPPED:
        cls = cls.__bases__[0]
    if cls is not type(mod):
        mod.__class__ = cls
    for name in ATTRS:
        mod.__dict__.pop(name, None)
