"""Mixture-of-experts weights stored as 3-D parameters (module surgery).

Hugging Face's experts modules (``MixtralExperts``, ``Qwen2MoeExperts``, ``OlmoeExperts``,
...: classes decorated with ``use_experts_implementation``) keep every expert's projection
in one parameter ``W [E, d_out, d_in]`` (``is_transposed``: ``[E, d_in, d_out]``) and see
the batch folded to token rows ``[N, d]`` with ``N = m·T`` (row ``r`` belongs to sample
``r // T``), routed by ``top_k_index [N, K]`` with weights ``top_k_weights [N, K]``.

Sample ``i``'s gradient of expert ``e``'s block is a sum over the sample's (token, slot)
pairs routed to ``e``: ``∂ℓ_i/∂W[e] = Σ_{s ∈ i, e_s = e} g_s x_sᵀ``. The capturing forward
computes the experts as the decorator's ``batched_mm`` implementation does (every
implementation the decorator dispatches to computes the same function), with each
projection through :class:`ExpertLinear`, whose backward records these per-sample
gradients ``P [m, E·d_out·d_in]`` (in the parameter's layout), so that each 3-D weight is
one ``"param"`` layer (a block of ``E·d_out·d_in`` columns of ``J``). That the token rows
are laid out sample-major is checked by prepare on ``example_inputs``
(:func:`.added_params.check_sample_independence`); a module used otherwise falls back.

Cost: ``P`` holds ``m`` copies of the weight, and its backward ``m`` times the flops of the
weight gradient; meant for small and medium expert widths. Expert biases ``b [E, d_out]``,
where a class has them, are ``"param"`` layers too (:class:`ExpertBias`, ``P[i, e] = Σ g_s``).
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Optional, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from . import ops
from .match import LayerSpec
from .params import ParamHolder
from .store import CaptureStore, Record, lookup
from .swapped import swapped_class

__all__ = ["experts_reason", "cover_experts", "ExpertLinear", "ExpertBias", "samples_of_rows", "is_experts"]

_FLAGS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "num_experts")


def is_experts(mod: nn.Module) -> bool:
    """Whether ``mod`` is a Hugging Face experts module (``use_experts_implementation``)."""
    moe = sys.modules.get("transformers.integrations.moe")
    return moe is not None and all(hasattr(mod, a) for a in (*_FLAGS, "config", "_apply_gate"))


def _projections(mod: nn.Module) -> list[str]:
    return ["gate_up_proj" if getattr(mod, "has_gate", False) else "up_proj", "down_proj"]


def _covered_params(mod: nn.Module) -> list[str]:
    """The projections' weights, then their biases where the class has them."""
    names = _projections(mod)
    return names + ([f"{pn}_bias" for pn in names] if getattr(mod, "has_bias", False) else [])


def experts_reason(mod: nn.Module) -> str:
    """``""`` when ``mod`` is an experts module whose 3-D weights are covered, else why not."""
    if not is_experts(mod):
        return "not a Hugging Face experts module"
    name = type(mod).__name__
    if getattr(mod, "_is_expert_parallel", False):
        return f"{name}: expert parallelism (experts sharded over devices) has no capture path"
    E: int = mod.__dict__.get("num_experts", 0)
    for pn in _covered_params(mod):
        w, dim = mod._parameters.get(pn), 2 if pn.endswith("_bias") else 3
        if not isinstance(w, nn.Parameter) or w.dim() != dim or w.shape[0] != E:
            return f"{name}: '{pn}' is not a Parameter [num_experts={E}, ...] of {dim} dims"
    try:
        params = list(inspect.signature(type(mod).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    if len(params) != 3 or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        return f"{name}: forward does not take (hidden_states, top_k_index, top_k_weights)"
    return ""


def samples_of_rows(n_rows: int, K: int, m: int, device: torch.device, name: str) -> Tensor:
    """Sample of each (token, slot) pair, ``[n_rows·K]``: token row ``r`` is sample ``r // T``."""
    if m <= 0 or n_rows % m:
        raise RuntimeError(
            f"tengrad_fx: experts module '{name}' received {n_rows} token rows for a batch of {m} samples; "
            "its tokens must be the batch folded sample-major ([m·T, d]). Prepare the model with "
            "example_inputs of the shape used for training.")
    return (torch.arange(n_rows, device=device) // (n_rows // m)).repeat_interleave(K)


class ExpertLinear(torch.autograd.Function):
    """``y[s] = W[e_s] x_s`` for pairs ``s`` (``x [S, d_in]``, ``expert_ids [S]``, ``W [E, d_out, d_in]``
    or transposed ``[E, d_in, d_out]``), ``y [S, d_out]``; its backward records
    ``P [m, W.numel()]``: ``P[i, e] = Σ_{s: samples[s] = i, e_s = e} g_s x_sᵀ`` (parameter layout)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, W: Tensor, expert_ids: Tensor, samples: Tensor, m: int,
                key: int, site: int, transposed: bool) -> Tensor:
        lookup(key).begin()
        ctx.save_for_backward(x, W, expert_ids, samples)
        ctx.conf = (m, key, site, transposed)
        return _apply(x, W, expert_ids, transposed)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, W, expert_ids, samples = ctx.saved_tensors
        m, key, site, transposed = ctx.conf
        store = lookup(key)
        need_x = ctx.needs_input_grad[0]
        gx = torch.zeros_like(x) if need_x else None
        P = grad.new_zeros(m, *W.shape)
        for e in expert_ids.unique().tolist():
            rows = (expert_ids == e).nonzero().flatten()
            ge, xe = grad[rows], x[rows]
            We = W[e].t() if transposed else W[e]  # [d_out, d_in]
            if gx is not None:
                gx[rows] = ge.matmul(We.to(ge.dtype)).to(x.dtype)
            onehot = F.one_hot(samples[rows], m).to(ge.dtype)  # [S_e, m]
            Pe = (onehot[:, :, None] * ge[:, None, :]).reshape(rows.numel(), -1).t().matmul(xe.to(ge.dtype))
            Pe = Pe.view(m, ge.shape[1], xe.shape[1])  # [m, d_out, d_in]
            P[:, e] = Pe.transpose(1, 2) if transposed else Pe
        P = P.reshape(m, -1)
        store.record(site, Record(None, None, P, grad.new_zeros(m, 0), (m, *x.shape[1:])))
        gW = W.new_zeros(W.shape) if store.grad_only else P.sum(0).view(W.shape).to(W.dtype)
        return gx, gW, None, None, None, None, None, None


class ExpertBias(torch.autograd.Function):
    """``y[s] + b[e_s]`` for pairs ``s`` (``y [S, d_out]``, ``b [E, d_out]``); its backward records
    ``P [m, b.numel()]``: ``P[i, e] = Σ_{s: samples[s] = i, e_s = e} g_s``."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, b: Tensor, expert_ids: Tensor, samples: Tensor, m: int,
                key: int, site: int) -> Tensor:
        lookup(key).begin()
        ctx.save_for_backward(expert_ids, samples)
        ctx.conf = (m, key, site, b.shape, b.dtype)
        return y + b[expert_ids]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        expert_ids, samples = ctx.saved_tensors
        m, key, site, shape, dtype = ctx.conf
        store = lookup(key)
        P = grad.new_zeros(m, *shape).index_put_((samples, expert_ids), grad, accumulate=True).reshape(m, -1)
        store.record(site, Record(None, None, P, grad.new_zeros(m, 0), (m, *grad.shape[1:])))
        gb = grad.new_zeros(shape, dtype=dtype) if store.grad_only else P.sum(0).view(shape).to(dtype)
        return grad, gb, None, None, None, None, None


def _apply(x: Tensor, W: Tensor, expert_ids: Tensor, transposed: bool) -> Tensor:
    """``y[s] = W[e_s] x_s``, one product per expert hit, ``[S, d_out]``."""
    d_out = W.shape[2] if transposed else W.shape[1]
    y = x.new_zeros(x.shape[0], d_out)
    for e in expert_ids.unique().tolist():
        rows = (expert_ids == e).nonzero().flatten()
        We = W[e].t() if transposed else W[e]
        y[rows] = F.linear(x[rows], We)
    return y


def _project(mod: nn.Module, pn: str, x: Tensor, expert_ids: Tensor, samples: Tensor, m: int,
             key: int, specs: dict[str, LayerSpec]) -> Tensor:
    """One projection of every pair: captured (:class:`ExpertLinear`) when its layer is on,
    plus the expert bias (``pn + '_bias'``) where the class has one."""
    W = getattr(mod, pn)
    spec = specs.get(pn)
    if spec is not None and spec.sites and W.requires_grad:
        y = ExpertLinear.apply(x, W, expert_ids, samples, m, key, spec.sites[0], bool(mod.is_transposed))
    else:
        y = _apply(x, W, expert_ids, bool(mod.is_transposed))
    if mod.has_bias:
        b = getattr(mod, f"{pn}_bias")
        bias = specs.get(f"{pn}_bias")
        if bias is not None and bias.sites and b.requires_grad:
            y = ExpertBias.apply(y, b, expert_ids, samples, m, key, bias.sites[0])
        else:
            y = y + b[expert_ids]
    return y


def _capturing_forward(self: Any, *args: Any, **kwargs: Any) -> Tensor:
    """The experts' output ``[N, d]`` as ``batched_mm`` computes it, its weights captured
    (arguments: ``hidden_states [N, d]``, ``top_k_index [N, K]``, ``top_k_weights [N, K]``,
    under the class's own names)."""
    key, specs, name = self.__dict__["_tengrad_experts"]
    m = ops.SAMPLES.get(key)
    if not (ops.ENABLED.get(key, False) and torch.is_grad_enabled()) or m is None:
        return self._tengrad_base.forward(self, *args, **kwargs)
    bound = inspect.signature(self._tengrad_base.forward).bind(self, *args, **kwargs)
    bound.apply_defaults()
    hidden_states, top_k_index, top_k_weights = list(bound.arguments.values())[1:]
    N, K = hidden_states.shape[0], top_k_index.shape[-1]
    samples = samples_of_rows(N, K, m, hidden_states.device, name)
    x = hidden_states.repeat_interleave(K, dim=0)
    expert_ids = top_k_index.reshape(-1)
    up, down = _projections(self)
    h = _project(self, up, x, expert_ids, samples, m, key, specs)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _project(self, down, h, expert_ids, samples, m, key, specs)
    if self.has_post_expert_norm:
        h = self.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1, 1)
    return h.view(N, K, -1).sum(dim=1)


def _capturing_class(cls: type) -> type:
    return swapped_class("experts", cls, {"forward": _capturing_forward, "_tengrad_base": cls})


def cover_experts(model: nn.Module, covered: set[int], fallback: dict[str, str],
                  store: CaptureStore) -> list[LayerSpec]:
    """One ``"param"`` layer per 3-D expert weight of each experts module of ``model``
    (module docstring); their ids join ``covered``. A module that cannot be covered keeps
    its reason in ``fallback`` for its weights."""
    layers = []
    for mod_name, mod in model.named_modules():
        if not is_experts(mod):
            continue
        why = experts_reason(mod)
        specs: dict[str, LayerSpec] = {}
        for pn in _covered_params(mod):
            full = f"{mod_name}.{pn}" if mod_name else pn
            w = mod._parameters.get(pn)
            if w is None:
                continue
            if why:
                fallback[full] = why
                continue
            spec = LayerSpec(name=full, kind="param", module=cast(nn.Module, ParamHolder(w)), sites=[store.n_sites],
                             surgery=True)  # rows sample-major: checked by check_sample_independence
            store.n_sites += 1
            specs[pn] = spec
            covered.add(id(w))
            layers.append(spec)
        if specs:
            mod.__class__ = _capturing_class(type(mod))
            mod.__dict__["_tengrad_experts"] = (store.key, specs, mod_name)
    if layers:
        ops.NEEDS_SAMPLES[store.key] = True
    return layers
