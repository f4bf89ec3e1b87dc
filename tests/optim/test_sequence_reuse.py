"""A reuse step's curvature work on layers over token sequences: the default keeps their ``J``.

From its ``I, G``, a Linear over ``S`` positions computes a reuse step's ``J g`` and ``Jᵀ c``
at ``2·m·S·n`` flops each, two thirds of the layer's own forward and backward
(``6·m·S·n``). By default (``jacobian_sites.default_jacobian_cap``) a materialized layer keeps
``J`` where it is at most ``min(4, S/8)`` times its ``I, G``, and those products cost
``2·m·n``. Counted by ``group_cost.reuse_cost`` (machine-independent); the update is the
same either way (float64).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.tengrad.jacobian_sites import default_jacobian_cap, factored_bytes
from tengrad_fx.optim.tengrad.group_cost import reuse_cost

M, S, VOCAB = 16, 16, 64


class TinyLM(nn.Module):
    """Tokens ``[m, S]`` → logits ``[m, S, VOCAB]`` through three Linears over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.fc1, self.fc2, self.head = nn.Linear(32, 128), nn.Linear(128, 32), nn.Linear(32, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(h + self.fc2(F.gelu(self.fc1(h))))


def _run(budget, steps: int = 3):
    torch.manual_seed(0)
    net = TinyLM().double()
    x = torch.randint(0, VOCAB, (M, S))
    pm = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=2, kl_clip=None, jacobian_budget_mb=budget)
    for t in range(steps):
        g = torch.Generator().manual_seed(t)
        xb, yb = torch.randint(0, VOCAB, (M, S), generator=g), torch.randint(0, VOCAB, (M, S), generator=g)
        opt.zero_grad()
        F.cross_entropy(pm(xb).flatten(0, 1), yb.flatten()).backward()
        opt.step()
    return pm, opt


def _linear_n(net: nn.Module) -> int:
    return sum(p.numel() for mod in net.modules() if isinstance(mod, nn.Linear) for p in mod.parameters())


def _linears_reuse_flops(opt) -> float:
    """Reuse-step curvature flops of the groups holding the Linears (``group_cost.reuse_cost``)."""
    return reuse_cost([g for g in opt.curvature.groups if all(lay.kind == "linear" for lay in g.layers)])[0]


def test_sequence_linears_keep_jacobian_within_the_cap() -> None:
    """Each Linear's ``J`` is 1.4–1.7× its ``I, G`` here (``S = 16``: cap 2×): all kept, so a
    reuse step's curvature work is under 10 % of the Linears' forward and backward; with a
    zero budget (nothing kept) it is over half of it."""
    pm, opt = _run(None)
    layers = {lay.name: lay for lay in opt._layers}
    for name in ("fc1", "fc2", "head"):
        lay = layers[name]
        n = sum(p.numel() for p in lay.params)
        shapes = [(M, S, lay.weight.shape[1])]
        assert factored_bytes(lay, shapes, 8) < M * n * 8 <= default_jacobian_cap(lay, shapes, 8), name
    model_flops = 6.0 * M * S * _linear_n(pm)
    kept = _linears_reuse_flops(opt)
    factored = _linears_reuse_flops(_run(0)[1])
    assert kept <= 0.1 * model_flops, (kept, model_flops)
    assert factored >= 0.5 * model_flops, (factored, model_flops)


@pytest.mark.parametrize("steps", [2, 3])
def test_kept_and_factored_reuse_give_the_same_update(steps: int) -> None:
    """The parameters after a curvature step and a reuse step (and one more curvature step)
    agree in float64 whether the Linears keep ``J`` or recompute from ``I, G``."""
    a, _ = _run(None, steps)
    b, _ = _run(0, steps)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-10, atol=1e-12), n
