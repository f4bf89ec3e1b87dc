"""Per-sample gradients of parameters used in any way, by replaying their module per sample.

A parameter no capture kernel covers (a state-space mixer's ``A_log``, ``D`` and the
convolution weight it hands to a kernel, a gated norm's weight, a relative-attention bias,
experts that are not a Hugging Face experts module) is still covered exactly when some
module ``M`` that uses it computes each sample's output rows from that sample's input rows
alone. For a call ``y = M(x)`` with ``x [m, ...]``, ``y [m, ...]``, sample ``i``'s gradient
of its own loss with respect to ``M``'s parameters ``θ`` is the vector–Jacobian product

    ∂ℓ_i/∂θ = (∂y_i/∂θ)ᵀ g_i,     y_i = M(θ; x_i),     g_i = ∂ℓ/∂y_i  (rows of the output gradient).

On capturing forwards (module surgery) ``M``'s class is swapped for one that routes its
per-sample outputs through an identity autograd function (:class:`_Tap`); its backward
receives ``g [m, ...]`` and computes these products for every ``i`` with ``torch.func``
(``vmap`` of ``vjp`` of :func:`torch.func.functional_call` on ``x_i``; one autograd call
per sample where ``vmap`` cannot run ``M``), recording ``P [m, θ.numel()]`` per parameter:
a ``"param"`` layer (a block of ``numel`` columns of ``J``). The replay runs ``M``'s plain
forward on copies of its buffers, with capture off.

``prepare`` picks ``M`` on ``example_inputs`` (:func:`cover_by_replay`): the module owning
the parameter, else its parent, and so on below the root, the first whose replay equals
the batch forward and whose rows sum to the batch gradient. Cost: one more forward and
backward of ``M`` on each curvature step, so the lowest such module is taken.
Random ops inside ``M`` (active dropout) are drawn afresh by the replay: such a module
fails the check on ``example_inputs`` when they are active there.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch import Tensor

from . import ops
from .eager import alias
from .info import PrepareInfo
from .inputs import leading_dim, map_tensors, resize_batch, run_call, tensor_leaves
from .match import LayerSpec
from .params import ParamHolder
from .store import Record, lookup
from .swapped import swapped_class
from .verify import cuda_devices, kept_buffers

__all__ = ["cover_by_replay", "Replay"]


@dataclass
class Replay:
    """A module whose parameters ``names`` (relative to it) are covered by replay."""

    key: int
    names: list[str]
    sites: list[int]
    checking: bool = False
    learning: bool = False  # a shapes-only forward: note which input leaves follow the batch
    # the input leaves (by position in the flattened call) that index samples; None: any
    # leaf whose leading dim is the batch
    positions: Optional[frozenset[int]] = None
    learned: dict[int, bool] = field(default_factory=dict)
    use_vmap: bool = True
    failure: str = ""  # set while checking: why the replay is not exact
    calls: int = 0  # capturing calls seen while checking


def _replay_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    rp: Replay = self.__dict__["_tengrad_replay"]
    out = self._tengrad_replayed.forward(self, *args, **kwargs)
    m = ops.SAMPLES.get(rp.key)
    if rp.sites and m is not None and ops.ENABLED.get(rp.key, False) and torch.is_grad_enabled():
        out = _tap(self, rp, m, (args, kwargs), out)
    return out


def _replay_class(cls: type) -> type:
    return swapped_class("replay", cls, {"forward": _replay_forward, "_tengrad_replayed": cls})


@dataclass
class _Call:
    """One capturing call: the inputs' leaves (tensors detached), which are per sample, the
    output leaves tapped and (checking) their values."""

    module: nn.Module
    replay: Replay
    m: int
    leaves: list[Any]
    tree: Any
    batched: list[bool]
    tapped: list[int]
    zeros: list[Tensor]  # zeros of each tapped output's shape (an output the loss does not reach)
    outputs: list[Tensor] = field(default_factory=list)


def _tap(mod: nn.Module, rp: Replay, m: int, inputs: Any, out: Any) -> Any:
    leaves, tree = pytree.tree_flatten(inputs)
    batched = [isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == m and (rp.positions is None or p in rp.positions)
               for p, t in enumerate(leaves)]
    if rp.learning or rp.checking:
        for p, b in enumerate(batched):
            rp.learned[p] = rp.learned.get(p, True) and b
        if rp.learning:
            return out
    outs = tensor_leaves(out)
    tapped = [j for j, t in enumerate(outs) if t.is_floating_point() and t.requires_grad and t.dim() > 0
              and t.shape[0] == m]
    if not tapped:
        return out
    leaves = [t.detach() if isinstance(t, Tensor) else t for t in leaves]
    call = _Call(mod, rp, m, leaves, tree, batched, tapped, [outs[j].new_zeros(()).expand_as(outs[j]) for j in tapped],
                 [outs[j].detach() for j in tapped] if rp.checking else [])
    lookup(rp.key).begin()
    rp.calls += rp.checking
    new = _Tap.apply(call, *(outs[j] for j in tapped))
    swap = {id(outs[j]): t for j, t in zip(tapped, new)}
    return map_tensors(lambda t: swap.get(id(t), t), out)


class _Tap(torch.autograd.Function):
    """Identity on a module's per-sample outputs; its backward records the per-sample
    gradients of the module's replayed parameters (module docstring)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *outs: Tensor) -> tuple[Tensor, ...]:
        ctx.call = call
        return tuple(alias(t) for t in outs)  # in-place ops on the outputs stay allowed

    @staticmethod
    def backward(ctx: Any, *grads: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
        call: _Call = ctx.call
        store = lookup(call.replay.key)
        if store.recording and not call.replay.failure:
            gs = [z if g is None else g for g, z in zip(grads, call.zeros)]
            try:
                rows = _per_sample_grads(call, gs)
            except Exception as exc:
                if not call.replay.checking:
                    raise
                call.replay.failure = f"its replay on one sample fails ({type(exc).__name__}: {str(exc)[:80]})"
                return (None, *grads)
            for site, P in zip(call.replay.sites, rows):
                store.record(site, Record(None, None, P, P.new_zeros(call.m, 0), (call.m,)))
        return (None, *grads)


@contextlib.contextmanager
def _plain(key: int) -> Iterator[None]:
    """Capture off for model ``key`` (the replay runs plain forwards), restored on exit."""
    enabled, samples = ops.ENABLED.get(key, False), ops.SAMPLES.pop(key, None)
    ops.ENABLED[key] = False
    try:
        yield
    finally:
        ops.ENABLED[key] = enabled
        if samples is not None:
            ops.SAMPLES[key] = samples


def _per_sample_grads(call: _Call, grads: list[Tensor]) -> list[Tensor]:
    """``[P [m, θ.numel()]]`` per replayed parameter ``θ`` of ``call``'s module."""
    rp, mod = call.replay, call.module
    params = {n: mod.get_parameter(n).detach() for n in rp.names}
    buffers = {n: b.detach().clone() for n, b in mod.named_buffers()}
    xs = [t for t, b in zip(call.leaves, call.batched) if b]

    def run(p: dict[str, Tensor], rows: list[Tensor]) -> tuple[Tensor, ...]:
        it = iter(rows)
        args, kwargs = pytree.tree_unflatten([next(it) if b else t for t, b in zip(call.leaves, call.batched)],
                                             call.tree)
        outs = tensor_leaves(torch.func.functional_call(mod, {**buffers, **p}, args, kwargs))
        return tuple(outs[j] for j in call.tapped)

    with _plain(rp.key), torch.enable_grad():
        got: Optional[dict[str, Tensor]] = None
        if rp.use_vmap:
            try:
                got = _vmapped(run, params, xs, grads, call)
            except Exception:  # data-dependent control flow, in-place updates of batched buffers, ...
                rp.use_vmap = False
        if got is None or rp.checking:
            looped = _looped(run, params, xs, grads, call)
            if got is not None and not _close(got, looped):
                rp.use_vmap = False  # vmap's batched kernels round differently (float32 inside)
            got = looped
    return [got[n].reshape(call.m, -1) for n in rp.names]


def _vmapped(run: Any, params: dict[str, Tensor], xs: list[Tensor], grads: list[Tensor],
             call: _Call) -> dict[str, Tensor]:
    def one(x_rows: list[Tensor], g_rows: list[Tensor]) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        res = torch.func.vjp(lambda p: run(p, [x.unsqueeze(0) for x in x_rows]), params)
        outs, pull = res[0], res[1]
        grads_p: dict[str, Tensor] = pull(tuple(g.unsqueeze(0) for g in g_rows))[0]
        return grads_p, outs

    got, outs = torch.func.vmap(one, randomness="error")(xs, grads)
    _compare(call, [o.flatten(0, 1) for o in outs])
    return got


def _looped(run: Any, params: dict[str, Tensor], xs: list[Tensor], grads: list[Tensor],
            call: _Call) -> dict[str, Tensor]:
    rows: dict[str, list[Tensor]] = {n: [] for n in params}
    outs_all: list[list[Tensor]] = []
    for i in range(call.m):
        p = {n: t.clone().requires_grad_() for n, t in params.items()}
        outs = run(p, [x[i:i + 1] for x in xs])
        outs_all.append([o.detach() for o in outs])
        pairs = [(o, g[i:i + 1]) for o, g in zip(outs, grads) if o.requires_grad]
        gr = torch.autograd.grad([o for o, _ in pairs], list(p.values()), [g for _, g in pairs],
                                 allow_unused=True) if pairs else [None] * len(p)
        for (n, t), g in zip(p.items(), gr):
            rows[n].append(torch.zeros_like(t) if g is None else g)
    _compare(call, [torch.cat(col) for col in zip(*outs_all)])
    return {n: torch.stack(r) for n, r in rows.items()}


def _close(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Do two sets of per-sample gradients agree to the rounding of their dtype?"""
    for n, t in a.items():
        tol = 1e-9 if t.dtype == torch.float64 else 1e-4
        if (t - b[n]).norm() > tol * b[n].norm().clamp_min(1e-30):
            return False
    return True


def _compare(call: _Call, replayed: list[Tensor]) -> None:
    """Checking: the replayed outputs must equal the batch's (else the module mixes samples)."""
    rp = call.replay
    if not rp.checking or rp.failure:
        return
    for a, b in zip(call.outputs, replayed):
        if a.shape != b.shape or not torch.allclose(a, b.to(a.dtype), rtol=1e-6, atol=1e-9):
            rp.failure = "replayed sample by sample, its outputs differ from the batch's (it mixes samples)"
            return


# --------------------------------------------------------------------------- choosing the module
def cover_by_replay(model: nn.Module, info: PrepareInfo, example_inputs: Sequence[Any]) -> None:
    """Module surgery: cover the parameters no layer covers by replaying a module that uses
    them (module docstring), chosen on ``example_inputs`` from the parameter's owner up to
    the root's children. Adds one ``"param"`` layer per parameter covered to ``info.layers``;
    the others keep their reasons in ``info.fallback``."""
    if info.method != "surgery":
        return
    covered = {id(p) for spec in info.layers if spec.sites for p in (spec.weight, spec.bias) if p is not None}
    orphans = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered and "." in n]
    if not orphans:
        return
    store, key = info.store, info.store.key
    sites = {}
    for n in orphans:
        sites[n] = store.n_sites
        store.n_sites += 1
    needed = ops.NEEDS_SAMPLES.get(key, False)
    ops.NEEDS_SAMPLES[key] = True
    groups = _by_module(orphans)
    chosen: dict[str, Replay] = {}
    while groups:
        replays, failed = _check(model, info, groups, sites, example_inputs)
        climbing: dict[str, list[str]] = {}
        for mod_name, names in groups.items():
            if mod_name not in failed:
                chosen[mod_name] = replays[mod_name]
                continue
            parent = mod_name.rpartition(".")[0]
            _note(info, model, names, mod_name, failed[mod_name])
            if failed[mod_name] and parent:  # below the root: replaying the whole model is the reference
                climbing.setdefault(parent, []).extend(names)
        groups = {mod_name: _names(chosen.pop(mod_name, None), mod_name) + names
                  for mod_name, names in climbing.items()}
    for mod_name, rp in chosen.items():
        rp.checking, rp.calls, rp.learned = False, 0, {}
        _install(model.get_submodule(mod_name), rp)
        for n in _names(rp, mod_name):
            p = model.get_parameter(n)
            info.layers.append(LayerSpec(name=n, kind="param", module=ParamHolder(p),  # type: ignore[arg-type]
                                         sites=[sites[n]], surgery=True))
            info.fallback.pop(n, None)
    ops.NEEDS_SAMPLES[key] = needed or bool(chosen)


def _names(rp: Optional[Replay], mod_name: str) -> list[str]:
    """The full names of the parameters ``rp`` replays (none for None)."""
    return [] if rp is None else [f"{mod_name}.{n}" for n in rp.names]


def _note(info: PrepareInfo, model: nn.Module, names: list[str], mod_name: str, why: str) -> None:
    """Add to each parameter's fallback reason why replaying ``mod_name`` does not cover it
    (``why`` empty: no gradient reaches it on ``example_inputs``)."""
    cls = type(model.get_submodule(mod_name)).__name__
    for n in names:
        first = info.fallback.get(n, "").split("; replaying ")[0].split("; unused")[0] or "no capture kernel"
        info.fallback[n] = (f"{first}; replaying {cls} '{mod_name}' per sample is not exact: {why}" if why else
                            f"{first}; unused on example_inputs (no gradient reaches it there)")


def _by_module(names: list[str]) -> dict[str, list[str]]:
    """Parameter names grouped by the module that holds them."""
    out: dict[str, list[str]] = {}
    for n in names:
        out.setdefault(n.rpartition(".")[0], []).append(n)
    return out


def _install(mod: nn.Module, rp: Replay) -> Replay:
    mod.__class__ = _replay_class(type(mod))
    mod.__dict__["_tengrad_replay"] = rp
    return rp


def _uninstall(mod: nn.Module) -> None:
    mod.__class__ = type(mod).__bases__[0]
    mod.__dict__.pop("_tengrad_replay", None)


def _check(model: nn.Module, info: PrepareInfo, groups: dict[str, list[str]], sites: dict[str, int],
           example_inputs: Sequence[Any]) -> tuple[dict[str, Replay], dict[str, str]]:
    """Replay ``groups`` (module name -> its parameters' names) on one forward and backward
    of ``example_inputs`` with a random cotangent; returns the replays and ``{module: reason}``
    for those that fail (reason ``""``: no gradient reaches its parameters there, nothing to
    climb for)."""
    store, key = info.store, info.store.key
    replays = {name: _install(model.get_submodule(name), Replay(key, [n[len(name) + 1:] for n in names],
                                                                [sites[n] for n in names], checking=True))
               for name, names in groups.items()}
    names = [n for ns in groups.values() for n in ns]
    params = [model.get_parameter(n) for n in names]
    store.clear()
    try:
        with kept_buffers(model), torch.random.fork_rng(devices=cuda_devices(model)), torch.enable_grad():
            torch.manual_seed(0)
            _learn_positions(model, list(replays.values()), example_inputs)
            outs = [t for t in tensor_leaves(run_call(model, list(example_inputs)))
                    if t.is_floating_point() and t.requires_grad]
            for rp in replays.values():  # learnt at both batch sizes
                rp.positions = frozenset(p for p, ok in rp.learned.items() if ok)
            total = sum(((t * torch.randn_like(t)).sum() for t in outs), torch.zeros(()))
            ref = torch.autograd.grad(total, params, allow_unused=True) if outs else [None] * len(params)
        grads = dict(zip(names, ref))
        failed = {name: _failure(rp, groups[name], grads, store.records, sites) for name, rp in replays.items()}
    finally:
        store.clear()
        for name in groups:
            mod = model.get_submodule(name)
            _uninstall(mod)
    return replays, {name: why for name, why in failed.items() if why is not None}


def _learn_positions(model: nn.Module, replays: list[Replay], example_inputs: Sequence[Any]) -> None:
    """Which input leaves of each replayed module index samples: those whose leading dim is
    the batch in every call at one more than the example batch (a shapes-only forward), and
    then (the checking forward, which narrows :attr:`Replay.positions` further) at the
    example batch: a constant that happens to have the batch's size at one batch size does
    not at both."""
    for rp in replays:
        rp.learning = True
    try:
        run_call(model, resize_batch(example_inputs, (leading_dim(*example_inputs) or 1) + 1))
    finally:
        for rp in replays:
            rp.learning = False
            rp.positions = frozenset(p for p, ok in rp.learned.items() if ok)


def _failure(rp: Replay, names: list[str], grads: dict[str, Optional[Tensor]], records: dict[int, list[Record]],
             sites: dict[str, int]) -> Optional[str]:
    """None when ``rp``'s rows sum to the batch gradient of each of its parameters, else why not."""
    if all(grads[n] is None for n in names):
        return ""
    if not rp.calls:
        return "not called with per-sample inputs and outputs"
    if rp.failure:
        return rp.failure
    for n in names:
        rows = [r.P for r in records.get(sites[n], []) if r.P is not None]
        g = grads[n]
        total = sum(rows[1:], rows[0]).sum(0) if rows else None
        ref = torch.zeros(()) if g is None else g.flatten()
        tol = 1e-6 if ref.dtype == torch.float64 else 1e-4
        if total is None or (total.to(ref.dtype) - ref).norm() > tol * ref.norm().clamp_min(1e-30):
            return "its per-sample rows do not sum to the batch gradient (the parameter is used outside it too)"
    return None
