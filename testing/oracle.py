"""Independent references: per-sample gradients by ``torch.func.vmap(grad(...))``."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor
from torch.func import functional_call, grad, jacrev, vmap


def per_sample_grads_reference(
    model: nn.Module, x: Any, loss_fn: Callable[[Tensor, Tensor], Tensor], y: Tensor,
) -> dict[str, Tensor]:
    """``{param name: [m, *param.shape]}`` of ``loss_fn(model(x_i[None]), y_i[None])``.

    ``model`` must be the ORIGINAL (unprepared) module, in eval mode if it has batch norm.
    ``x`` is a tensor or a pytree of them (dicts, tuples, lists, registered dataclasses):
    the tensor leaves whose leading dim is ``m = len(y)`` are split into samples, the
    other leaves are passed whole to every sample's call.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}
    leaves, spec = pytree.tree_flatten(x)
    m = y.shape[0]
    idx = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == m]

    def loss_i(p: dict[str, Tensor], batched: list[Tensor], yi: Tensor) -> Tensor:
        parts = list(leaves)
        for i, t in zip(idx, batched):
            parts[i] = t.unsqueeze(0)
        out = functional_call(model, (p, buffers), (pytree.tree_unflatten(parts, spec),))
        return loss_fn(out, yi.unsqueeze(0))

    return vmap(grad(loss_i), in_dims=(None, 0, 0))(params, [leaves[i] for i in idx], y)


def output_jacobians_reference(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """``{param name: [m, k, *param.shape]}``: per-sample Jacobians ``∂f(x_i)/∂θ`` of the
    ``k`` flattened outputs, by ``vmap(jacrev(...))`` on the ORIGINAL module."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def f_i(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        return functional_call(model, (p, buffers), (xi.unsqueeze(0),)).reshape(-1)

    return vmap(jacrev(f_i), in_dims=(None, 0))(params, x)


def explicit_jacobian(psg: dict[str, Tensor], weight_name: str, bias_name: Optional[str]) -> Tensor:
    """``J`` (``[m, n]``) with rows ``vec(dW_i, db_i)`` from reference per-sample grads."""
    parts = [psg[weight_name].flatten(1)]
    if bias_name is not None:
        parts.append(psg[bias_name].flatten(1))
    return torch.cat(parts, 1)


def dense_layer_updates(model: nn.Module, x: Tensor, y: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor],
                        grads: dict[str, Tensor], damping: float,
                        covered: dict[str, str], metric: Optional[dict[str, Tensor]] = None) -> dict[str, Tensor]:
    """``{param name: u}`` with ``u = solve(JᵀJ/m + αD, g)`` per covered layer (``covered``:
    param name -> layer name, as in ``PrepareInfo.covered``), ``J`` from ``vmap(grad)``
    on the ORIGINAL ``model`` and ``g`` from ``grads``; ``D`` block-diagonal over the layer's
    parameters, from ``metric`` (param name -> its diagonal, the parameter's shape, or its
    full block ``[n, n]``, ``n`` its size; I where absent)."""
    psg = per_sample_grads_reference(model, x, loss_fn, y)
    layers: dict[str, list[str]] = {}
    for pn, layer in covered.items():
        layers.setdefault(layer, []).append(pn)
    out = {}
    for names in layers.values():
        names = [n for n in names if n in grads]  # a frozen parameter is in no block
        if not names:
            continue
        names.sort(key=lambda n: not n.endswith("weight"))
        J = torch.cat([psg[n].flatten(1) for n in names], 1)
        m, n = J.shape
        gv = torch.cat([grads[k].flatten() for k in names])
        d = torch.block_diag(*[_metric_block(metric, k, grads[k]) for k in names])
        u = torch.linalg.solve(J.T @ J / m + damping * d.to(J.dtype), gv)
        off = 0
        for k in names:
            out[k] = u[off: off + grads[k].numel()].view_as(grads[k])
            off += grads[k].numel()
    return out


def _metric_block(metric: Optional[dict[str, Tensor]], name: str, g: Tensor) -> Tensor:
    """``D``'s block ``[n, n]`` of parameter ``name`` (gradient ``g``, ``n`` entries)."""
    if not metric or name not in metric:
        return torch.eye(g.numel(), dtype=g.dtype)
    d = metric[name]
    return torch.diag(d.flatten()) if d.shape == g.shape else d


def check_tengrad_step(model: nn.Module, opt: torch.optim.Optimizer, orig: nn.Module, x: Tensor, y: Tensor,
                       damping: float, tol: float = 1e-8) -> None:
    """One ``opt.step()`` (``lr=1``, no momentum) on the prepared ``model`` after a
    cross-entropy backward equals ``-u`` of :func:`dense_layer_updates` on ``orig`` for
    EVERY trainable parameter (all of them must be covered; frozen ones must not move)."""
    from tengrad_fx import get_info  # testing helpers may import the package

    F.cross_entropy(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    ref = dense_layer_updates(orig, x, y, F.cross_entropy, grads, damping, get_info(model).covered)
    assert set(ref) == set(grads), set(grads) - set(ref)
    for n, p in model.named_parameters():
        d = before[n] - p.detach()
        if n not in ref:
            assert not d.any(), f"{n}: frozen, but moved"
            continue
        err = ((d - ref[n]).norm() / ref[n].norm().clamp_min(1e-300)).item()
        assert err <= tol, f"{n}: rel err {err:.2e}"


def check_covered_layers(orig: nn.Module, prepared: nn.Module, x: Tensor, y: Tensor, tol: float = 1e-10,
                         loss_fn: Callable[[Tensor, Tensor], Tensor] = F.cross_entropy) -> None:
    """After a ``loss_fn`` backward through ``prepared``: every covered layer's per-sample
    gradients, its Gram by the three strategies, ``J·v`` and ``Jᵀc`` equal those of
    ``J`` from ``vmap(grad)`` on the ORIGINAL ``orig`` (relative error ≤ ``tol``)."""
    from tengrad_fx import covered_layers  # testing helpers may import the package

    def rel(a: Tensor, b: Tensor) -> float:
        return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

    loss_fn(prepared(x), y).backward()
    ref = per_sample_grads_reference(orig, x, loss_fn, y)
    names = {id(p): n for n, p in prepared.named_parameters()}
    gen = torch.Generator().manual_seed(5)
    for layer in covered_layers(prepared):
        wn = names[id(layer.weight)]
        bn = names[id(layer.bias)] if layer.bias is not None else None
        dW, db = layer.per_sample_grads()
        assert rel(dW, ref[wn]) <= tol, layer.name
        if bn is not None:
            assert rel(db, ref[bn]) <= tol, layer.name
        J = explicit_jacobian(ref, wn, bn)
        for strategy in ("factor", "materialize", "auto"):
            assert rel(layer.gram(strategy), J @ J.T) <= tol, (layer.name, strategy)
        v = torch.randn(J.shape[1], generator=gen, dtype=J.dtype)
        nw = layer.weight.numel()
        vb = v[nw:].view_as(layer.bias) if layer.bias is not None else None
        assert rel(layer.jvp(v[:nw].view_as(layer.weight), vb), J @ v) <= tol, layer.name
        c = torch.randn(J.shape[0], generator=gen, dtype=J.dtype)
        gw, gb = layer.vjp(c)
        got = gw.flatten() if gb is None else torch.cat([gw.flatten(), gb.flatten()])
        assert rel(got, J.T @ c) <= tol, layer.name


def stacked_layer_jacobians(layer: Callable[[Tensor, Tensor, Optional[Tensor]], Tensor], w: Tensor,
                            b: Optional[Tensor], I: Tensor, G: Tensor) -> Tensor:
    """``J [L, m, n]`` of ``L`` stacked layers ``y = layer(x, w, b)`` (``I [m, L, ...]``,
    ``G [m, L, ...]``): rows ``vec(∂/∂w, ∂/∂b)`` of ``Σ layer(x_i)·G_i`` per sample (no
    ``∂/∂b`` with ``b`` None), by ``vmap(grad(...))``."""
    def loss(wt: Tensor, bt: Optional[Tensor], xi: Tensor, gi: Tensor) -> Tensor:
        return (layer(xi[None], wt, bt) * gi[None]).sum()

    Js = []
    for l in range(I.shape[1]):
        if b is not None:
            dW, db = vmap(grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(w, b, I[:, l], G[:, l])
            Js.append(torch.cat([dW.flatten(1), db], 1))
        else:
            Js.append(vmap(grad(loss), in_dims=(None, None, 0, 0))(w, None, I[:, l], G[:, l]).flatten(1))
    return torch.stack(Js)


def newton_schulz_reference(m: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """``U diag(pˢ(σ/‖M‖_F)) Vᵀ``: the quintic applied to the singular values by the SVD."""
    a, b, c = 3.4445, -4.7750, 2.0315  # Muon's quintic, written out: independent of the library
    left, sv, right = torch.linalg.svd(m, full_matrices=False)
    x = sv / sv.square().sum().sqrt()
    for _ in range(steps):
        x = a * x + b * x ** 3 + c * x ** 5
    return left * x @ right
