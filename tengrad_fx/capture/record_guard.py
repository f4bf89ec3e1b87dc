"""Records that no compiled program can overwrite.

A ``torch.library`` custom op declared without mutated arguments and with outputs that
alias nothing promises the compiler that, once the op has returned, its arguments and
results belong to the program alone. Inductor relies on it: it reuses a buffer as soon as
the program stops reading it (e.g. the ReLU's input gradient is written into the buffer
that held the ReLU's output, which the next Linear's backward op had just recorded as
its ``I``). A capture op's backward keeps some of its arguments (``I``, ``G``) in the
:class:`~.store.CaptureStore` beyond the call, so, when it runs as a custom op (under
``torch.compile``, or :data:`~.eager.FORCE_CUSTOM_OPS`):

* :func:`kept_apart` wraps the op's body: every tensor the body records that shares
  memory with an argument or a result of the op is replaced by a copy that only the store
  holds (tensors the body computes itself, e.g. ``P``, are kept as they are);
* a tripwire checks that promise: the first records of each site and shape are
  fingerprinted when recorded, and :func:`verify` (called by
  :meth:`~.store.CaptureStore.finalize` and before any curvature is read) recomputes the
  fingerprints and raises, naming the layer, if a recorded tensor changed since. With
  :data:`CHECK` = ``"always"`` every record is checked, ``"off"`` checks none.

The eager path (:mod:`.eager`'s ``autograd.Function``) needs neither: eager tensors are
reference-counted, and a recorded one is never handed to anybody else's memory.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch
from torch import Tensor

from .inputs import tensor_leaves

__all__ = ["CHECK", "kept_apart", "copy_aliased", "verify", "RecordOverwritten"]

# When the recorded tensors of a custom-op capture are fingerprinted (module docstring).
CHECK: Literal["first", "always", "off"] = "first"

# While a custom op's body runs: the (store, site, record) triples it recorded.
_PENDING: Optional[list[tuple[Any, int, Any]]] = None

_FIELDS = ("I", "G", "P", "Gsum")


class RecordOverwritten(RuntimeError):
    """A recorded tensor changed between its record and its use."""


def kept_apart(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` (a capture op's backward) whose records share no memory with the op's
    arguments or results (:func:`copy_aliased`)."""

    @functools.wraps(body)
    def run(*args: Any) -> Any:
        global _PENDING
        outer, _PENDING = _PENDING, []
        try:
            out = body(*args)
            recorded = _PENDING
        finally:
            _PENDING = outer
        if recorded:
            copy_aliased(recorded, tensor_leaves((args, out)))
        return out

    return run


def note(store: Any, site: int, rec: Any) -> None:
    """Called by :meth:`~.store.CaptureStore.record`: remember ``rec`` while a custom
    op's body runs (no-op otherwise)."""
    if _PENDING is not None:
        _PENDING.append((store, site, rec))


def copy_aliased(recorded: list[tuple[Any, int, Any]], owned: list[Tensor]) -> None:
    """Replace each recorded tensor that shares storage with one of ``owned`` (the op's
    arguments and results) by a copy, then fingerprint it if :data:`CHECK` asks."""
    ptrs = {t.untyped_storage().data_ptr() for t in owned if t.numel()}
    for store, site, rec in recorded:
        for name in _FIELDS:
            t = getattr(rec, name)
            if t is not None and t.numel() and t.untyped_storage().data_ptr() in ptrs:
                setattr(rec, name, copy_record_tensor(t))
        if CHECK != "off":
            store.watch(site, rec, CHECK == "always")


def copy_record_tensor(t: Tensor) -> Tensor:
    """A copy of ``t`` with its own memory (one home, so that a test can break it)."""
    return t.clone()


@dataclass
class Watched:
    """One recorded tensor and its fingerprint at record time."""

    site: int
    sig: tuple  # the record's (site, shapes)
    name: str
    tensor: Tensor
    fingerprint: Tensor


def fingerprint(t: Tensor) -> Tensor:
    """``[3]`` float64: the sum, the sum of magnitudes and a position-weighted sum of
    ``t`` (a permutation or an overwrite changes at least one)."""
    v = t.detach().reshape(-1).to(torch.float64)
    w = torch.linspace(1.0, 2.0, v.numel(), dtype=torch.float64, device=v.device)
    return torch.stack((v.sum(), v.abs().sum(), (v * w).sum()))


def watch(rec: Any, site: int, sig: tuple) -> list[Watched]:
    """Fingerprints of ``rec``'s tensors (``sig``: the record's site and shapes)."""
    return [Watched(site, sig, name, t, fingerprint(t)) for name in _FIELDS
            if (t := getattr(rec, name)) is not None and t.numel()]


def verify(watched: list[Watched], site_names: dict[int, str]) -> None:
    """Raise :class:`RecordOverwritten` if a watched tensor's fingerprint changed (one
    host read for all of them)."""
    if not watched:
        return
    now = torch.stack([fingerprint(w.tensor) for w in watched])
    then = torch.stack([w.fingerprint for w in watched])
    bad = (now != then).any(1)
    if not bool(bad.any()):
        return
    w = watched[int(bad.nonzero()[0, 0])]
    layer = site_names.get(w.site, f"site {w.site}")
    raise RecordOverwritten(
        f"tengrad_fx: layer '{layer}': its recorded {w.name} changed after the backward recorded it "
        "(the compiled program reused that memory), so this capture's curvature would be wrong; "
        "nothing was updated. Run the model eagerly or with torch.compile(backend='aot_eager'), and "
        "report the torch version and backend.")
