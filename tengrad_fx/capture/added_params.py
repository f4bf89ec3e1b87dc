"""Added parameters (class tokens, position embeddings) on the module-surgery path.

A parameter ``p [1, *rest]`` held directly by a module that is not a covered layer (ViT's
``cls_token``, ``position_embeddings``) is read in that module's forward through
``nn.Module.__getattr__``. The module's class is swapped for a subclass whose
``__getattr__`` hands out, on capturing forwards, ``p`` broadcast to the batch
(``[m, *rest]``, :mod:`.params`' ``param_batch`` op): the same values for every consumer
that broadcasts ``p`` against per-sample tensors (``x + p``, ``p.expand(m, ...)``,
``torch.cat``), and the tensor whose gradient rows are the per-sample gradients.

The surgery path cannot see how ``p`` is used, so ``prepare`` checks it on
``example_inputs`` (:func:`check_sample_independence`): with a cotangent on sample 0
only, every other row of the recorded per-sample gradients must be zero; a use that mixes
samples (``p.mean(0)``, a batch statistic) fails that and ``p`` falls back, with the reason.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from . import ops, params
from .inputs import resize_batch, run_call, tensor_leaves
from .match import LayerSpec
from .params import ParamHolder
from .sharing import drop_layer
from .store import CaptureStore
from .swapped import swapped_class
from .verify import cuda_devices

__all__ = ["cover_added_params", "check_sample_independence"]


def cover_added_params(model: nn.Module, covered: set[int], fallback: dict[str, str],
                       store: CaptureStore) -> list[LayerSpec]:
    """One ``"param"`` layer per parameter ``[1, *rest]`` of a module that is not a covered
    layer (``covered``: ids of the covered layers' parameters); others get their reason
    in ``fallback``. Their modules' classes read them through :func:`_batched_getattr`."""
    layers = []
    for mod_name, mod in model.named_modules():
        mine = {}
        for pn, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{pn}" if mod_name else pn
            if id(p) in covered or full in fallback:
                continue
            if p.dim() < 2 or p.shape[0] != 1:
                fallback[full] = (f"{type(mod).__name__}: added parameter of shape {tuple(p.shape)} (module "
                                  "surgery covers [1, ...] tokens and position embeddings only)")
                continue
            site = store.n_sites
            store.n_sites += 1
            spec = LayerSpec(name=full, kind="param", module=ParamHolder(p), sites=[site],  # type: ignore[arg-type]
                             surgery=True)  # checked by check_sample_independence
            mine[pn] = spec
            layers.append(spec)
        if mine:
            mod.__class__ = _added_class(type(mod))
            mod.__dict__["_tengrad_added"] = (store.key, mine)
    if layers:
        ops.NEEDS_SAMPLES[store.key] = True
    return layers


def _batched_getattr(self: Any, name: str) -> Any:
    value = self._tengrad_base_getattr(name)
    key, mine = self.__dict__["_tengrad_added"]
    spec = mine.get(name)
    if spec is None or not spec.sites:
        return value
    m = ops.SAMPLES.get(key)
    if m is None:
        return value
    y = params._run(value, [m, *value.shape[1:]], None, key, spec.sites[0], None, spec.name)
    return value if y is None else y


def _added_class(cls: type[nn.Module]) -> type:
    """``cls`` whose ``__getattr__`` hands out its added parameters batched (module docstring)."""
    return swapped_class("added", cls, {"__getattr__": _batched_getattr, "_tengrad_base_getattr": cls.__getattr__})


def check_sample_independence(prepared: nn.Module, layers: list[LayerSpec], store: CaptureStore,
                              example_inputs: Sequence[Any]) -> None:
    """Drop the added parameters (kind ``"param"`` of :func:`cover_added_params`) whose
    recorded gradient rows are not per sample: at batch 3, a random cotangent on sample 0 of
    the output (its first floating tensor leaf with leading dim 3) must give zero rows 1, 2."""
    checked = [spec for spec in layers if spec.sites and spec.surgery]
    if not checked:
        return
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=cuda_devices(prepared)):
            torch.manual_seed(0)
            out = run_call(prepared, resize_batch(example_inputs, 3))
            leaf = next((t for t in tensor_leaves(out) if t.is_floating_point() and t.dim() > 0
                         and t.shape[0] == 3 and t.requires_grad), None)
            if leaf is None:
                reason = "added parameter: no per-sample output to check its use on"
                for spec in checked:
                    drop_layer({spec.name: spec}, spec.name, reason)
                return
            cot = torch.zeros_like(leaf)
            cot[0] = torch.randn_like(leaf[0])
            ps = [spec.weight for spec in checked]
            torch.autograd.grad(leaf, ps, cot, allow_unused=True)
            for spec in checked:
                rows = [r.P for r in store.records.get(spec.sites[0], []) if r.P is not None]
                P = torch.cat(rows, 1) if rows else None
                if P is not None and P[1:].abs().max() > 1e-6 * P[0].abs().max().clamp_min(1e-30):
                    drop_layer({spec.name: spec}, spec.name, "added parameter used in a way that mixes samples "
                               "(its gradient for sample 0 reaches other samples' rows)")
    finally:
        store.clear()
