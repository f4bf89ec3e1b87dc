"""Covered layers that a forward does not call (a data-dependent branch, an unused head,
an expert not routed to): skipped when they have no gradient; with a gradient but no
record they get the SGD-momentum update, counted in ``opt.counters["uncaptured"]``; with
``curvature_every > 1`` a layer captured at the last curvature step keeps its factors."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from testing import explicit_jacobian, per_sample_grads_reference


class Branch(nn.Module):
    """``a(h) if h.sum() > 0 else b(h)``: data-dependent, so prepared by module surgery."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 5)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        return self.a(h) if h.sum() > 0 else self.b(h)


class Fixed(Branch):
    """The same parameters with the branch fixed (torch.func cannot vmap the ``if``)."""

    def __init__(self, use_a: bool) -> None:
        super().__init__()
        self.use_a = use_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        return self.a(h) if self.use_a else self.b(h)


def _reference(model: nn.Module, use_a: bool) -> nn.Module:
    ref = Fixed(use_a).double()
    ref.load_state_dict({k: v for k, v in model.state_dict().items()})
    return ref


def _batch(seed: int, m: int = 6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 4, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (m,), generator=g)


def _setup(**kw):
    torch.manual_seed(0)
    net = Branch().double()
    with torch.no_grad():  # make the branch follow the sign of x's first column
        net.stem.weight.zero_()
        net.stem.weight[:, 0] = 1.0
        net.stem.bias.zero_()
    template = copy.deepcopy(net)
    model = tengrad_fx.prepare(net, example_inputs=(_pos(0)[0][:2],))
    assert tengrad_fx.get_info(model).method == "surgery"
    return template, model, TENGraD(model, lr=1.0, damping=0.1, momentum=0.0,
                                    **{"curvature_every": 1, "kl_clip": None, **kw})


def _pos(seed: int):
    x, y = _batch(seed)
    x[:, 0] = x[:, 0].abs() + 0.5  # h.sum() > 0: branch a
    return x, y


def _neg(seed: int):
    x, y = _batch(seed)
    x[:, 0] = -x[:, 0].abs() - 0.5  # branch b
    return x, y


def _step(model, opt, x, y) -> dict[str, torch.Tensor]:
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}, grads


def _ngd(template, model, x, y, names, alpha=0.1):
    ref = _reference(model, names[0].startswith("a"))
    psg = per_sample_grads_reference(ref, x, F.cross_entropy, y)
    J = explicit_jacobian(psg, *names)
    g = J.mean(0)
    return torch.linalg.solve(J.T @ J / J.shape[0] + alpha * torch.eye(J.shape[1], dtype=J.dtype), g)


def test_layer_not_called_is_skipped_and_others_exact() -> None:
    template, model, opt = _setup()
    x, y = _pos(1)
    want = _ngd(template, model, x, y, ("a.weight", "a.bias"))
    u, grads = _step(model, opt, x, y)
    assert grads["b.weight"] is None
    assert torch.count_nonzero(u["b.weight"]) == 0 and torch.count_nonzero(u["b.bias"]) == 0
    got = torch.cat([u["a.weight"].flatten(), u["a.bias"]])
    assert ((got - want).norm() / want.norm()).item() < 1e-10
    assert opt.counters["uncaptured"] == 0
    x, y = _neg(2)  # now the other branch
    want = _ngd(template, model, x, y, ("b.weight", "b.bias"))
    u, _ = _step(model, opt, x, y)
    assert torch.count_nonzero(u["a.weight"]) == 0
    got = torch.cat([u["b.weight"].flatten(), u["b.bias"]])
    assert ((got - want).norm() / want.norm()).item() < 1e-10
    assert opt.counters == {"step": 2, "skipped": 0, "uncaptured": 0}


def _check_gradient_without_record(model, opt) -> None:
    """b's call runs with capture off (no record) while b gets a gradient: one step moves
    b by exactly ``g`` (lr 1, no momentum) and counts one uncaptured layer-step."""
    x, y = _pos(3)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with tengrad_fx.capturing(model, False):
        loss = loss + 0.1 * model.b(torch.tanh(model.stem(x))).square().mean()
    loss.backward()
    g_b = model.b.weight.grad.clone()
    before = model.b.weight.detach().clone()
    uncaptured = opt.counters["uncaptured"]
    opt.step()
    assert torch.allclose(before - model.b.weight.detach(), g_b, rtol=0, atol=1e-15)
    assert opt.counters["uncaptured"] == uncaptured + 1


def test_gradient_without_record_gets_sgd_and_is_counted() -> None:
    """Capture switched off for one call (the layer's record is missing) while its
    gradient exists: u = g for its parameters, counted."""
    _, model, opt = _setup()
    _check_gradient_without_record(model, opt)


def test_cached_factors_kept_across_reuse_steps() -> None:
    """curvature_every=3: a is captured at the curvature step; on the next (reuse) step
    b's branch runs (b: gradient, no record: SGD, counted); on the step after that a's
    update still uses its cached curvature: (F₀ + αI)⁻¹ g with F₀ of the curvature batch."""
    template, model, opt = _setup(curvature_every=3)
    x0, y0 = _pos(4)
    ref0 = _reference(model, True)  # the weights the curvature batch saw
    psg0 = per_sample_grads_reference(ref0, x0, F.cross_entropy, y0)
    J0 = explicit_jacobian(psg0, "a.weight", "a.bias")
    _step(model, opt, x0, y0)
    x1, y1 = _neg(5)
    u1, g1 = _step(model, opt, x1, y1)
    assert opt.counters["uncaptured"] == 1
    assert torch.allclose(u1["b.weight"], g1["b.weight"], rtol=0, atol=1e-15)
    x2, y2 = _pos(6)
    u2, g2 = _step(model, opt, x2, y2)
    F0 = J0.T @ J0 / J0.shape[0]
    g = torch.cat([g2["a.weight"].flatten(), g2["a.bias"]])
    want = torch.linalg.solve(F0 + 0.1 * torch.eye(F0.shape[0], dtype=F0.dtype), g)
    got = torch.cat([u2["a.weight"].flatten(), u2["a.bias"]])
    assert ((got - want).norm() / want.norm()).item() < 1e-10
    assert torch.count_nonzero(u2["b.weight"]) == 0
    assert opt.counters == {"step": 3, "skipped": 0, "uncaptured": 1}


@pytest.mark.parametrize("name", ["kfac", "ekfac", "kbfgs", "ngd"])
def test_baselines_branch_layers_and_gradient_without_record(name: str) -> None:
    """The baselines share the step skeleton: a layer the forward does not call is skipped
    (parameters unchanged), and a layer with a gradient but no record gets ``u = g``
    (SGD-momentum, no momentum here), counted in ``opt.counters["uncaptured"]``."""
    from tengrad_fx.optim.registry import make_optimizer

    _, model, _ = _setup()
    opt = make_optimizer(name, model, lr=1.0, damping=0.1, momentum=0.0, weight_decay=0.0)
    b_before = model.b.weight.detach().clone()
    _step(model, opt, *_pos(1))  # branch a: b has no gradient and no record
    assert torch.equal(model.b.weight.detach(), b_before)
    assert opt.counters["uncaptured"] == 0
    _check_gradient_without_record(model, opt)
