"""torch.optim param groups in TENGraD and the baselines: per-group lr / weight decay /
momentum / damping, LambdaLR per group, add_param_group, parameters in no group, and a
state-dict round trip with two groups. Float64, tiny models, one or a few steps."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim import make_optimizer
from tengrad_fx.optim.baselines import EKFAC, KBFGS, KFAC, NGD
from testing.oracle import dense_layer_updates

# every optimizer with per-step curvature, no KL clip (exact per-step updates)
EXACT: dict[str, tuple[type, dict[str, Any]]] = {
    "tengrad": (TENGraD, dict(curvature_every=1, kl_clip=None)),
    "kfac": (KFAC, dict(kl_clip=None, curvature_every=1, inverse_every=1)),
    "ekfac": (EKFAC, dict(kl_clip=None, curvature_every=1, inverse_every=1, rescale_every=1)),
    "kbfgs": (KBFGS, dict(kl_clip=None, curvature_every=1, inverse_every=1)),
    "ngd": (NGD, dict(kl_clip=None)),
}
LAYERS = ("0", "2", "4")  # the Linears of _mlp


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _batch(seed: int, m: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (m,), generator=g)


def _prepared(template: nn.Module) -> nn.Module:
    return tengrad_fx.prepare(copy.deepcopy(template), example_inputs=(_batch(99, 2)[0],))


def _params(model: nn.Module, *layers: str) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if n.split(".")[0] in layers]


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> dict[str, torch.Tensor]:
    """One step on batch ``seed``: ``{name: before − after}``."""
    x, y = _batch(seed)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def _one_group_u(name: str, template: nn.Module, damping: float) -> dict[str, torch.Tensor]:
    """``u`` of every parameter: one group, ``lr = 1``, no momentum or weight decay."""
    cls, kw = EXACT[name]
    model = _prepared(template)
    return _step(model, cls(model, lr=1.0, damping=damping, momentum=0.0, weight_decay=0.0, **kw), 1)


def _close(a: torch.Tensor, b: torch.Tensor, what: str, rtol: float = 1e-9) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=1e-13, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------- (a) + (c): fallback = SGD
@pytest.mark.parametrize("name", sorted(EXACT))
def test_fallback_groups_follow_sgd_with_lambda_lr_per_group(name: str) -> None:
    """LayerNorm parameters (fallbacks with only_linear_conv) in two groups with their own
    lr / weight decay / momentum, each driven by its own LambdaLR lambda, move as
    torch.optim.SGD moves them; the Linears, in no group, do not move at all."""
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()
    ref = copy.deepcopy(net)
    model = tengrad_fx.prepare(net, example_inputs=(_batch(99, 2)[0],), only_linear_conv=True)
    spec = [dict(lr=0.1, weight_decay=1e-2, momentum=0.9), dict(lr=0.03, weight_decay=0.0, momentum=0.5)]
    cls, kw = EXACT[name]
    opt = cls(model, lr=0.5, damping=0.1, params=[{"params": [model.get_parameter("1.weight")], **spec[0]},
                                                  {"params": [model.get_parameter("1.bias")], **spec[1]}], **kw)
    sgd = torch.optim.SGD([{"params": [ref[1].weight], **spec[0]}, {"params": [ref[1].bias], **spec[1]}], lr=0.5)
    lambdas = [lambda t: 0.5 ** t, lambda t: 1.0 + t]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambdas) for o in (opt, sgd)]
    linears = [p.detach().clone() for p in _params(model, "0", "3")]
    for t in range(4):
        x, y = _batch(t)
        for mod, o in ((model, opt), (ref, sgd)):
            o.zero_grad()
            F.cross_entropy(mod(x), y).backward()
            o.step()
        for s in scheds:
            s.step()
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 * 0.5 ** (t + 1), 0.03 * (t + 2)])
        for n in ("1.weight", "1.bias"):
            _close(model.get_parameter(n), ref.get_parameter(n), f"{n} step {t}", rtol=1e-12)
    for before, p in zip(linears, _params(model, "0", "3")):
        assert torch.equal(before, p)


# ----------------------------------------------------------------------- (b): covered layers
@pytest.mark.parametrize("name", sorted(EXACT))
def test_group_lr_and_damping_scale_each_layers_exact_update(name: str) -> None:
    """Two groups with their own lr and damping: each layer moves by its group's lr times
    the one-group update at its group's damping (the curvature blocks are per layer)."""
    template = _mlp()
    u1, u2 = _one_group_u(name, template, 0.05), _one_group_u(name, template, 0.5)
    cls, kw = EXACT[name]
    model = _prepared(template)
    opt = cls(model, lr=1.0, damping=0.05, momentum=0.0, **kw,
              params=[{"params": _params(model, "0", "2"), "lr": 0.3},
                      {"params": _params(model, "4"), "lr": 0.15, "damping": 0.5}])
    d = _step(model, opt, 1)
    for n in d:
        want = 0.3 * u1[n] if not n.startswith("4") else 0.15 * u2[n]
        _close(d[n], want, n)


@pytest.mark.parametrize("update_form", ["auto", "woodbury"])
def test_tengrad_per_group_damping_against_dense_fisher(update_form: str) -> None:
    """TENGraD with two dampings: each layer's step is lr·(F_l + α_l I)⁻¹ g_l, F_l from
    vmap(grad) per-sample gradients (push-through and Woodbury forms)."""
    template = _mlp()
    model = _prepared(template)
    opt = TENGraD(model, lr=0.2, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None,
                  update_form=update_form, params=[{"params": _params(model, "0", "4")},
                                                   {"params": _params(model, "2"), "damping": 0.7}])
    x, y = _batch(1)
    F.cross_entropy(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    covered = tengrad_fx.get_info(model).covered
    ref = {}
    for alpha, layers in ((0.05, ("0", "4")), (0.7, ("2",))):
        sub = {pn: lay for pn, lay in covered.items() if pn.split(".")[0] in layers}
        ref.update(dense_layer_updates(template, x, y, F.cross_entropy, grads, alpha, sub))
    for n, p in model.named_parameters():
        _close(before[n] - p.detach(), 0.2 * ref[n], n, rtol=1e-8)


@pytest.mark.parametrize("name", ["tengrad", "kfac"])
def test_weight_and_bias_in_groups_of_their_own(name: str) -> None:
    """A layer's weight and bias in different groups: one curvature block, each tensor its
    own group's lr and weight decay on its slice of the update."""
    template = _mlp()
    u = _one_group_u(name, template, 0.1)
    cls, kw = EXACT[name]
    model = _prepared(template)
    w, b = model.get_parameter("4.weight"), model.get_parameter("4.bias")
    opt = cls(model, lr=0.2, damping=0.1, momentum=0.0, weight_decay=1e-2, **kw,
              params=[{"params": [*_params(model, "0", "2"), w]}, {"params": [b], "lr": 0.05, "weight_decay": 0.1}])
    w0, b0 = w.detach().clone(), b.detach().clone()
    d = _step(model, opt, 1)
    _close(d["4.weight"], 0.2 * (u["4.weight"] + 1e-2 * w0), "weight")
    _close(d["4.bias"], 0.05 * (u["4.bias"] + 0.1 * b0), "bias")
    _close(d["0.weight"], 0.2 * (u["0.weight"] + 1e-2 * template[0].weight.detach()), "0.weight")


@pytest.mark.parametrize("lrs", [(0.3, 0.1), (0.2, 0.2)])
def test_tengrad_kl_clip_over_groups(lrs: tuple[float, float]) -> None:
    """The KL clip over groups: ν = min(1, sqrt(κ / Σ_G lr_G²·Σ_{p∈G} u_p·g_p)), here with
    two dampings too (equal lrs: ν from TENGraD's m-vector dots)."""
    template = _mlp()
    us = {0.05: _one_group_u("tengrad", template, 0.05), 0.5: _one_group_u("tengrad", template, 0.5)}
    model = _prepared(template)
    kappa = 1e-6
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=kappa,
                  params=[{"params": _params(model, "0", "2"), "lr": lrs[0]},
                          {"params": _params(model, "4"), "lr": lrs[1], "damping": 0.5}])
    x, y = _batch(1)
    F.cross_entropy(model(x), y).backward()
    g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    lr_of = {n: lrs[1] if n.startswith("4") else lrs[0] for n in g}
    u = {n: us[0.5 if n.startswith("4") else 0.05][n] for n in g}
    ug = sum(lr_of[n] ** 2 * (u[n] * g[n]).sum() for n in g)
    nu = min(1.0, (kappa / ug).sqrt().item())
    assert nu < 0.5  # the clip is active
    for n, p in model.named_parameters():
        _close(before[n] - p.detach(), lr_of[n] * nu * u[n], n, rtol=1e-8)


# ----------------------------------------------------------------------- (d): add_param_group
@pytest.mark.parametrize("name", sorted(EXACT))
def test_add_param_group_joins_the_curvature(name: str) -> None:
    """A layer in no group does not move; once added (own lr and damping) it is covered:
    the step equals a fresh optimizer's built with both groups."""
    template = _mlp()
    cls, kw = EXACT[name]
    model = _prepared(template)
    opt = cls(model, lr=0.2, damping=0.1, momentum=0.0, **kw, params=_params(model, "0", "2"))
    last = [p.detach().clone() for p in _params(model, "4")]
    d0 = _step(model, opt, 0)
    assert all(torch.equal(a, p) for a, p in zip(last, _params(model, "4")))
    assert d0["0.weight"].abs().sum() > 0
    new = {"params": _params(model, "4"), "lr": 0.5, "damping": 0.3}
    opt.add_param_group(new)
    twin = _prepared(template)
    twin.load_state_dict(model.state_dict())
    fresh = cls(twin, lr=0.2, damping=0.1, momentum=0.0, **kw,
                params=[{"params": _params(twin, "0", "2")}, {**new, "params": _params(twin, "4")}])
    d, want = _step(model, opt, 1), _step(twin, fresh, 1)
    assert d["4.weight"].abs().sum() > 0
    for n in d:
        _close(d[n], want[n], n, rtol=1e-12)


def test_add_param_group_refuses_bad_groups() -> None:
    template = _mlp()
    model = _prepared(template)
    opt = TENGraD(model, lr=0.2, damping=0.1, params=_params(model, "0"))
    with pytest.raises(ValueError, match="param group 1: damping"):
        opt.add_param_group({"params": _params(model, "2"), "damping": 0.0})
    with pytest.raises(ValueError, match="not a parameter of the prepared model"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1  # nothing half-added
    opt.add_param_group({"params": _params(model, "2")})
    assert [lay.name for lay in opt._layers] == ["0", "2"]


def test_missing_group_keys_take_the_defaults() -> None:
    model = _prepared(_mlp())
    opt = make_optimizer("kfac", model, lr=0.1, damping=0.2, momentum=0.8, weight_decay=1e-3,
                         params=[{"params": _params(model, "0", "2")}, {"params": _params(model, "4"), "lr": 0.5}])
    a, b = opt.param_groups
    assert (a["lr"], b["lr"]) == (0.1, 0.5)
    assert a["damping"] == b["damping"] == 0.2 and b["momentum"] == 0.8 and b["weight_decay"] == 1e-3
    with pytest.raises(ValueError, match="not a parameter of the prepared model"):
        TENGraD(model, lr=0.1, damping=0.1, params=[nn.Parameter(torch.zeros(2))])


# ----------------------------------------------------------------------- (e): state dict
@pytest.mark.parametrize("name", ["tengrad", "kfac"])
def test_state_dict_round_trip_with_two_groups(name: str) -> None:
    """Save after 3 steps (momentum buffers, curvature kept between steps), load into a
    fresh optimizer over a copy: the next steps are bit for bit the original's."""
    template = _mlp()
    kw: dict[str, Any] = dict(curvature_every=2) if name == "tengrad" else dict(curvature_every=2, inverse_every=2)
    cls = TENGraD if name == "tengrad" else KFAC

    def build(model: nn.Module) -> torch.optim.Optimizer:
        return cls(model, lr=0.1, damping=0.1, momentum=0.9, **kw,
                   params=[{"params": _params(model, "0", "2"), "weight_decay": 1e-2},
                           {"params": _params(model, "4"), "lr": 0.03, "momentum": 0.5, "damping": 0.4}])

    model = _prepared(template)
    opt = build(model)
    for t in range(3):
        _step(model, opt, t)
    sd = copy.deepcopy(opt.state_dict())
    assert [g["lr"] for g in sd["param_groups"]] == [0.1, 0.03]
    twin = _prepared(template)
    twin.load_state_dict(model.state_dict())
    resumed = build(twin)
    resumed.load_state_dict(sd)
    for t in range(3, 5):
        _step(model, opt, t)
        _step(twin, resumed, t)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    one = cls(_prepared(template), lr=0.1, damping=0.1, **kw)
    with pytest.raises(ValueError, match="2 param groups"):
        one.load_state_dict(sd)


def test_tengrad_cuda_graph_path_on_cpu_with_two_groups() -> None:
    """``cuda_graph=True`` on a CPU (static gradients, the graph runner, run eagerly) with
    two groups of their own lr / damping / momentum: bit for bit ``cuda_graph=False``."""
    template = _mlp()
    out = []
    for cuda_graph in (False, True):
        model = _prepared(template)
        opt = TENGraD(model, lr=0.1, damping=0.1, curvature_every=3, kl_clip=1e-3, cuda_graph=cuda_graph,
                      params=[{"params": _params(model, "0", "2")},
                              {"params": _params(model, "4"), "lr": 0.03, "damping": 0.4, "momentum": 0.5}])
        for t in range(5):
            _step(model, opt, t)
        out.append([p.detach().clone() for p in model.parameters()])
    assert opt.graph_runner.graphs.eager_runs == 3  # the reuse steps (1, 2, 4) went through the graph runner
    for a, b in zip(*out):
        assert torch.equal(a, b)
