"""Weight sharing and tying among covered layers: which layers must fall back, and why.

A covered weight also read outside its layer call (functional reuse, tied weights read by
another op) or registered under several modules (weight tying) makes its layer inexact, so
the layer is dropped to the SGD fallback with a reason per parameter. One exception is
exact: embeddings tied to each other and to at most one bias-free Linear (a language
model's input and output embeddings) stay covered as one block (:func:`merge_tied_lookups`).
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from .embedding import BIASED_HOST_SITES
from .match import LayerSpec

__all__ = ["OURS", "reads_value", "note_functional_uses", "param_owners", "note_tied", "merge_tied_lookups",
           "drop_layer"]

OURS = "tengrad_fx_capture_arg"
# reading only these attributes of a covered weight does not use its value
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}
_META_METHODS = {"size", "dim", "numel", "type", "get_device"}
META_ATTRS, META_METHODS = frozenset(_META_ATTRS), frozenset(_META_METHODS)  # for other capture modules


def reads_value(node: fx.Node) -> bool:
    """Does any user of this ``get_attr`` node read the tensor's values (not just metadata)?"""
    for user in node.users:
        if user.op == "call_function" and user.target is getattr and len(user.args) > 1 \
                and user.args[1] in _META_ATTRS:
            continue
        if user.op == "call_method" and user.target in _META_METHODS:
            continue
        return True
    return False


def note_functional_uses(gm: fx.GraphModule, g_train: fx.Graph, g_eval: Optional[fx.Graph],
                         layers: dict[str, LayerSpec], fallback: dict[str, str]) -> None:
    """A covered weight also read elsewhere (tied weights, functional use) is not exact."""
    owners = param_owners(layers.values())
    for graph in (g for g in (g_train, g_eval) if g is not None):
        for node in graph.nodes:
            if node.op == "get_attr" and not node.meta.get(OURS) and reads_value(node):
                try:
                    t = gm.get_parameter(str(node.target))
                except AttributeError:
                    continue
                for name in owners.get(id(t), []):
                    drop_layer(layers, name, f"also read outside the layer call ({node.target})", t,
                                f"parameter also read outside the layer call ({node.target})")
    note_tied(gm, layers, owners)


def param_owners(specs: Iterable[LayerSpec]) -> dict[int, list[str]]:
    """``id(parameter) -> names of the layers holding it`` (weight and bias)."""
    owners: dict[int, list[str]] = {}
    for spec in specs:
        for t in (spec.weight, spec.bias):
            if t is not None:
                owners.setdefault(id(t), []).append(spec.name)
    return owners


def note_tied(model: nn.Module, layers: dict[str, LayerSpec], owners: dict[int, list[str]]) -> None:
    """The same Parameter registered under several modules (weight tying): all owners fall back."""
    seen: dict[int, tuple[str, nn.Module]] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for pn, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{pn}" if mod_name else pn
            first = seen.setdefault(id(p), (full, mod))
            if first[1] is not mod:  # one module under two names is sharing, not tying
                if _tie_lookup(layers, owners.get(id(p), [])):
                    continue
                if _one_reader(model, p, layers):
                    continue
                for name in owners.get(id(p), []):
                    drop_layer(layers, name, f"tied ({first[0]} = {full})", p,
                                f"parameter tied (shared with {full})")


def _tie_lookup(layers: dict[str, LayerSpec], names: list[str]) -> bool:
    """Tied embeddings: ``nn.Embedding`` modules holding one weight ``[vocab, D]``, with at
    most one bias-free ``nn.Linear`` holding it too (tied input/output embeddings). Note
    the lookups on the host spec (the Linear, else the first lookup) for
    :func:`merge_tied_lookups` and keep them covered."""
    specs = [layers[n] for n in dict.fromkeys(names) if n in layers]
    embs = [spec for spec in specs if spec.kind == "embedding"]
    lins = [spec for spec in specs if spec.kind == "linear"]
    if not embs or len(lins) > 1 or len(embs) + len(lins) != len(specs) or len(specs) < 2:
        return False
    host = lins[0] if lins else embs[0]
    if any(spec.weight is not host.weight for spec in specs):
        return False
    if not lins and len({spec.module.padding_idx for spec in embs}) > 1:
        return False
    host.tied_lookups = [spec for spec in embs if spec is not host]
    return True


def merge_tied_lookups(layers: list[LayerSpec], store: Any) -> list[LayerSpec]:
    """One Fisher block per tied weight: each tied lookup's call sites join its host's (a
    tied Linear's backward records a lookup in Linear's layout: ``store.onehot_sites``,
    :func:`..capture.embedding.linear_record`) and the lookup's own spec leaves ``layers``.
    If any of them was uncovered (e.g. by the batch probe), all fall back."""
    out = list(layers)
    for host in layers:
        embs, host.tied_lookups = host.tied_lookups, []
        if not embs:
            continue
        off = next((spec for spec in (host, *embs) if not spec.sites), None)
        if off is not None:
            for spec in (host, *embs):
                if spec.sites:
                    drop_layer({spec.name: spec}, spec.name, f"tied with '{off.name}', which is not covered",
                               spec.weight, f"parameter tied with '{off.name}', which is not covered")
            continue
        for emb in embs:
            host.sites += emb.sites
            if host.kind == "linear" and host.bias is not None:  # the lookup adds nothing to the bias
                host.input_shapes += [_cancel_bias_shape(shape, emb.weight.shape[1]) for shape in emb.input_shapes]
                store.onehot_sites |= set(emb.sites)
                BIASED_HOST_SITES.setdefault(store.key, set()).update(emb.sites)
            elif host.kind == "linear":
                host.input_shapes += [(*shape, emb.weight.shape[1]) for shape in emb.input_shapes]
                store.onehot_sites |= set(emb.sites)
            else:
                host.input_shapes += emb.input_shapes
            out.remove(emb)
        host.tied_names = [emb.name for emb in embs]
    return out


def _cancel_bias_shape(idx_shape: tuple[int, ...], d: int) -> tuple[int, ...]:
    """The input shape of a lookup recorded for a biased Linear: ``[m, P + 1, D]``
    (:func:`..capture.embedding.linear_record`, ``cancel_bias``)."""
    p = 1
    for n in idx_shape[1:]:
        p *= n
    return (idx_shape[0], p + 1, d)


def _one_reader(model: nn.Module, p: torch.Tensor, layers: dict[str, LayerSpec]) -> bool:
    """``p`` registered under one covered layer and under other modules whose own forward
    provably never reads it (BERT's ``predictions.bias``, the same Parameter as
    ``predictions.decoder.bias``, which only the decoder uses): not a tie. Proven by
    tracing each such module's forward with ``torch.fx`` (submodules traced through or kept
    as leaves by the default tracer): no node reads the parameter by any of its names."""
    by_module = {id(spec.module): spec for spec in layers.values() if spec.sites}
    holders = [mod for _, mod in model.named_modules(remove_duplicate=False)
               if any(q is p for q in mod._parameters.values())]
    readers = {id(mod) for mod in holders if id(mod) in by_module}
    if len(readers) != 1:
        return False
    for mod in holders:
        if id(mod) not in readers and not _never_reads(mod, p):
            return False
    return True


def _never_reads(mod: nn.Module, p: torch.Tensor) -> bool:
    """Does ``mod``'s forward, traced, read ``p`` nowhere (no ``get_attr`` of any of its names)?"""
    names = {n for n, q in mod.named_parameters(remove_duplicate=False) if q is p}
    try:
        graph = _ThroughTracer().trace(mod)
    except Exception:
        return False
    return not any(node.op == "get_attr" and node.target in names for node in graph.nodes)


class _ThroughTracer(fx.Tracer):
    """The default tracer, tracing through modules that are not submodules of the root
    (a global activation module such as transformers' ``gelu``)."""

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            self.path_of_module(m)
        except NameError:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)


def drop_layer(layers: dict[str, LayerSpec], name: str, reason: str,
                param: Optional[torch.Tensor] = None, param_reason: str = "") -> None:
    """Uncover layer ``name``. ``param``: the parameter that caused it; it gets
    ``param_reason``, the layer's other parameters "layer '<name>' not covered: its
    weight|bias is <reason>"; without ``param`` every parameter gets ``reason``."""
    spec = layers.get(name)
    if spec is not None:
        spec.dropped_sites.extend(spec.sites)
        spec.sites = []  # marks it uncovered; _classify_params records the reason
        if param is None:
            spec.fallback_reason = reason
            return
        which = "weight" if param is spec.weight else "bias"
        spec.fallback_reason = f"layer '{name or '(root)'}' not covered: its {which} is {reason}"
        spec.param_reasons[id(param)] = param_reason
