"""A prepared model's records (what its backward captured) and their comparison, e.g.
compiled against eager on the same model and batch."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

import tengrad_fx

__all__ = ["Snapshot", "RECORD_TOL", "snapshot", "rel", "assert_same", "compile_model"]

Snapshot = dict[tuple[str, int, str], Tensor]

# Relative error allowed between compiled and eager records (a compiled program may order
# its sums differently).
RECORD_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def snapshot(pm: nn.Module) -> Snapshot:
    """Copies of every record's tensors (``I``, ``G``, ``P``, ``Gsum``), keyed by
    (layer, call, field)."""
    store = tengrad_fx.get_info(pm).store
    out: Snapshot = {}
    for site, recs in store.records.items():
        for j, r in enumerate(recs):
            for f in ("I", "G", "P", "Gsum"):
                t = getattr(r, f)
                if t is not None:
                    out[(store.site_names.get(site, str(site)), j, f)] = t.detach().clone()
    return out


def rel(a: Tensor, b: Tensor, floor: float = 0.0) -> float:
    """``‖a − b‖ / max(‖b‖, floor)`` (integer tensors: 0 if equal, else inf)."""
    if a.dtype in (torch.int64, torch.int32):
        return 0.0 if torch.equal(a, b) else float("inf")
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(max(floor, 1e-300))).item()


def _floor(snap: Snapshot, key: tuple[str, int, str]) -> float:
    """The scale below which ``snap[key]`` is rounding noise: for ``Gsum`` (a sum of ``G``
    over positions, which may cancel, e.g. before an instance norm, and keep the rounding
    of its terms) 100 times the norm of its record's ``G`` or ``P``; 0 for the other fields."""
    if key[2] != "Gsum":
        return 0.0
    return 100.0 * max((snap[(*key[:2], f)].double().norm().item() for f in ("G", "P") if (*key[:2], f) in snap),
                       default=0.0)


def assert_same(got: Snapshot, want: Snapshot, tol: float) -> None:
    """Same records (keys, shapes) and every tensor within relative error ``tol`` (a
    ``Gsum`` relative to at least its record's ``G`` or ``P``: see :func:`_floor`)."""
    assert sorted(got) == sorted(want), f"recorded fields differ: {sorted(set(got) ^ set(want))}"
    errs = {k: rel(got[k], want[k], _floor(want, k)) for k in want if got[k].shape == want[k].shape}
    bad = {k: errs.get(k, float("inf")) for k in want if errs.get(k, float("inf")) > tol}
    assert not bad, f"compiled records differ from eager (relative error > {tol}): {bad}"


def compile_model(pm: nn.Module, backend: str = "inductor") -> Any:
    """``torch.compile(pm, backend=backend)``, and a check that it compiled a graph on
    its first call (rather than running eagerly, e.g. past dynamo's cache limit)."""
    compiled = torch.compile(pm, backend=backend)
    counters = torch._dynamo.utils.counters["stats"]
    first = [True]

    def run(*args: Any) -> Any:
        before = counters["unique_graphs"]
        out = compiled(*args)
        if first[0]:
            assert counters["unique_graphs"] > before, "torch.compile compiled no graph (ran eagerly)"
            first[0] = False
        return out

    return run
