"""Records of a prepared model's backward, eager or compiled (compared by
:func:`testing.records.assert_same`), and per-sample gradients against torch.func."""
from __future__ import annotations

import copy
import functools
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from testing.oracle import per_sample_grads_reference
from testing.records import Snapshot, assert_same, rel, snapshot

from ._models import batch, make

__all__ = ["prepare", "backward", "eager_records", "compiled_records", "assert_same", "assert_per_sample"]


def prepare(name: str, dtype: torch.dtype = torch.float64, train: bool = True,
            jacobian: bool = False) -> tuple[nn.Module, nn.Module]:
    """``(original, prepared copy)`` of ``make(name)``; ``jacobian``: every site
    materializes ``P`` in its backward."""
    orig = make(name, dtype)
    x, _ = batch(name, 2, dtype=dtype)
    pm = tengrad_fx.prepare(copy.deepcopy(orig), example_inputs=(x,))
    pm.train(train)
    orig.train(train)
    if jacobian:
        store = tengrad_fx.get_info(pm).store
        store.jacobian_sites = set(store.site_names)
    return orig, pm


def backward(pm: nn.Module, fwd: Any, name: str, m: int, seed: int = 0,
             dtype: torch.dtype = torch.float64, device: str = "cpu") -> Snapshot:
    """The records of one backward through ``fwd`` on ``device``, on the CPU."""
    x, y = batch(name, m, seed, dtype)
    F.cross_entropy(fwd(x.to(device)), y.to(device)).backward()
    return {k: v.cpu() for k, v in snapshot(pm).items()}


@functools.lru_cache(maxsize=None)
def eager_records(name: str, m: int, seed: int = 0, dtype: torch.dtype = torch.float64, train: bool = True,
                  jacobian: bool = False) -> Snapshot:
    _, pm = prepare(name, dtype, train, jacobian)
    return backward(pm, pm, name, m, seed, dtype)


def compiled_records(name: str, sizes: tuple[int, ...], dtype: torch.dtype = torch.float64, train: bool = True,
                     jacobian: bool = False, device: str = "cpu", **compile_kw: Any) -> list[Snapshot]:
    """The records of one compiled model's backward at each batch size in ``sizes``, on
    ``device`` (brought back to the CPU)."""
    _, pm = prepare(name, dtype, train, jacobian)
    pm.to(device)
    fwd = torch.compile(pm, **compile_kw)
    return [backward(pm, fwd, name, m, i, dtype, device) for i, m in enumerate(sizes)]


def assert_per_sample(orig: nn.Module, pm: nn.Module, name: str, m: int, seed: int, tol: float,
                      fwd: Optional[Any] = None) -> None:
    """After a backward through ``fwd`` (default ``pm``): every covered layer's per-sample
    gradients equal ``vmap(grad)`` of the original model."""
    x, y = batch(name, m, seed)
    F.cross_entropy((pm if fwd is None else fwd)(x), y).backward()
    ref = per_sample_grads_reference(orig, x, F.cross_entropy, y)
    names = {id(p): n for n, p in pm.named_parameters()}
    for layer in tengrad_fx.covered_layers(pm):
        dW, db = layer.per_sample_grads()
        assert rel(dW, ref[names[id(layer.weight)]]) <= tol, layer.name
        if layer.bias is not None:
            assert rel(db, ref[names[id(layer.bias)]]) <= tol, layer.name
