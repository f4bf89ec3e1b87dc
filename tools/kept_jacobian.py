"""Which layers keep ``J`` between steps, and what that does to a reuse step and to memory.

For each model, one TENGraD curvature step on a random batch of ``m`` samples, then the
cached curvature under two rules for the materialized layers
(:func:`tengrad_fx.optim.tengrad.jacobian_sites.default_jacobian_cap`):

* ``default``: ``J`` kept where it is at most ``min(4, S/8)`` times its ``I, G``;
* ``J<=IG``: ``J`` kept only where it is no larger than its ``I, G`` (the cap at 1×).

Printed per rule: the layers keeping ``J``, a reuse step's curvature flops
(``group_cost.reuse_cost``: ``J g``, ``Jᵀ c``, triangular solves) against the model's own
forward and backward (``6·m·Σ S·n`` over the covered layers), and the curvature kept in
memory (``tools.opt_memory.curvature_bytes``). Machine-independent: counts, not timings::

    python -m tools.kept_jacobian --models 3c1f,resnet18,mixer,gpt2-bytes-m,llama-bytes-m --m 32
"""
from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.tengrad import jacobian_sites
from tengrad_fx.optim.tengrad.group_cost import reuse_cost
from tengrad_fx.zoo.bench_models import MODEL_NAMES, build_model

from .opt_memory import curvature_bytes

__all__ = ["kept_facts", "main"]


def _model(name: str, m: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, bool]:
    """``(model, x, y, lm)``: a benchmark model with a random batch, or a byte-level LM
    (``tools.lm_workloads.build_lm``) with random tokens over its context."""
    g = torch.Generator().manual_seed(0)
    if name in MODEL_NAMES:
        net, shape = build_model(name)
        return net, torch.randn(m, *shape, generator=g), torch.randint(0, 10, (m,), generator=g), False
    from .lm_workloads import build_lm
    net, ctx = build_lm(name)
    x = torch.randint(0, 256, (m, ctx + 1), generator=g)
    return net, x[:, :-1], x[:, 1:], True


def _model_flops(opt: Any, m: int) -> float:
    """``6·m·S·n`` summed over the captured covered layers (forward and backward of the
    weights; read from the records before the step)."""
    return sum(6.0 * m * lay.dims()[1] * sum(p.numel() for p in lay.params) for lay in opt._layers if lay.captured)


def kept_facts(name: str, m: int, ratio_max: float) -> dict[str, Any]:
    """One curvature step of model ``name`` at batch ``m`` with ``JACOBIAN_RATIO_MAX = ratio_max``:
    ``{kept: layers keeping J, reuse_ratio: reuse flops / model flops, curvature_mb}``."""
    old = jacobian_sites.JACOBIAN_RATIO_MAX
    jacobian_sites.JACOBIAN_RATIO_MAX = ratio_max
    try:
        torch.manual_seed(0)
        net, x, y, lm = _model(name, m)
        pm = tengrad_fx.prepare(net, example_inputs=(x[:2],))
        opt = tengrad_fx.TENGraD(pm, lr=0.01, damping=0.1, curvature_every=10)
        out = pm(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) if lm else F.cross_entropy(logits, y)
        loss.backward()
        model_flops = _model_flops(opt, m)
        opt.step()
        kept = sorted(lay.name for g in opt.curvature.groups if g.form == "P" for lay in g.layers)
        return {"kept": kept, "reuse_ratio": reuse_cost(opt.curvature.groups)[0] / model_flops,
                "curvature_mb": curvature_bytes(opt, pm) / 2**20, "layers": len(opt._layers)}
    finally:
        jacobian_sites.JACOBIAN_RATIO_MAX = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="3c1f,resnet18,mixer,gpt2-bytes-m,llama-bytes-m")
    ap.add_argument("--m", type=int, default=32)
    a = ap.parse_args()
    print(f"m={a.m}; reuse = a reuse step's curvature flops / the covered layers' forward+backward flops")
    print(f"{'model':16} {'rule':8} {'kept J':>9} {'reuse':>8} {'curvature MB':>13}")
    for name in a.models.split(","):
        rows = {rule: kept_facts(name, a.m, r) for rule, r in (("default", jacobian_sites.JACOBIAN_RATIO_MAX),
                                                               ("J<=IG", 1.0))}
        for rule, f in rows.items():
            print(f"{name:16} {rule:8} {len(f['kept']):>4}/{f['layers']:<4} {f['reuse_ratio']:>8.3f} "
                  f"{f['curvature_mb']:>13.1f}")
        changed = sorted(set(rows["default"]["kept"]) - set(rows["J<=IG"]["kept"]))
        if changed:
            print(f"  keeping J by default only: {', '.join(changed)}")


if __name__ == "__main__":
    main()
