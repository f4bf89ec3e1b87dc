"""Random small models, and the check of one TENGraD step against dense block NGD.

A model is a plan (plain dicts drawn by :func:`model_cases`) turned into an ``nn.Module``
by :class:`PlanNet`:

* ``family``: ``"conv2d"`` (input ``[m, C, H, W]``), ``"conv1d"`` (``[m, C, L]``) or
  ``"seq"`` (``[m, T, D]``, Linear layers on sequences);
* blocks: a covered layer (random groups, stride, dilation, padding and padding mode,
  bias), a norm (BatchNorm in eval mode, GroupNorm, InstanceNorm, LayerNorm), an
  activation (ReLU, in-place ReLU / LeakyReLU / Hardtanh / ELU, or tanh / GELU),
  pooling, and a residual branch ``act(norm(layer(h)) + h)`` (the add in place or not;
  the branch layer may be called twice, so one layer has two calls);
* a head: global average pooling or flatten, an optional hidden Linear, a Linear to the
  classes.

:func:`check_step` prepares the model, takes one TENGraD step (lr 1, no momentum or
weight decay, so the step is ``-u``) on a cross-entropy loss and compares ``u`` with the
float64 reference: for every covered layer ``(JᵀJ/m + αI)⁻¹ g`` with ``J`` the per-sample
gradients of an unprepared copy (one sample at a time, :func:`per_sample_grads_loop`),
``u = g`` for every other parameter. With ``compiled``, the prepared model's forward and
backward run through ``torch.compile``, and its records must also equal those of an eager
run of the same model and batch (:data:`~testing.records.RECORD_TOL`).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import assume
from hypothesis import strategies as st

import tengrad_fx

from .oracle import explicit_jacobian
from .records import RECORD_TOL, Snapshot, assert_same, compile_model, snapshot

__all__ = ["model_cases", "PlanNet", "build_model_case", "check_step", "per_sample_grads_loop", "STEP_TOL",
           "ACTS", "COMPILE_ACTS"]

STEP_TOL = 1e-8  # relative, per layer, float64

_CONV = {1: nn.Conv1d, 2: nn.Conv2d}
_BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d}
_IN = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d}
_POOL = {("max", 1): nn.MaxPool1d, ("max", 2): nn.MaxPool2d, ("avg", 1): nn.AvgPool1d, ("avg", 2): nn.AvgPool2d}
ACTS = ("relu", "relu_", "leaky_", "hardtanh_", "elu_", "tanh", "gelu")
# Weighted to the activations whose backward lets a compiled program reuse a recorded
# input's memory (a ReLU's output is the next layer's I; its input gradient may go there).
COMPILE_ACTS = ("relu", "relu", "relu_", "relu_", "leaky_", "hardtanh_", "tanh", "gelu")


def _act(name: str) -> nn.Module:
    return {"relu": nn.ReLU, "relu_": lambda: nn.ReLU(inplace=True),
            "leaky_": lambda: nn.LeakyReLU(0.1, inplace=True),
            "hardtanh_": lambda: nn.Hardtanh(-2.0, 2.0, inplace=True), "elu_": lambda: nn.ELU(inplace=True),
            "tanh": nn.Tanh, "gelu": nn.GELU}[name]()


# --------------------------------------------------------------------------- plans
@st.composite
def _conv_layer(draw: Any, nd: int, c_in: int, size: tuple[int, ...], same: bool) -> dict[str, Any]:
    """A conv plan on ``[c_in, *size]``; ``same``: output shape = input shape."""
    divisors = [g for g in (1, 2, 3, c_in) if c_in % g == 0]
    groups = draw(st.sampled_from(divisors))
    c_out = c_in if same else groups * draw(st.integers(1, max(1, 6 // groups)))
    kernel = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2))
    if same:
        stride, padding = 1, "same"
        pad = (dilation * (kernel - 1) + 1) // 2
    else:
        stride = draw(st.integers(1, 2))
        pad = draw(st.integers(0, 1))
        padding = pad
    ok = all(pad < n for n in size)  # reflect / circular need the pad inside the input
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"])) if pad and ok else "zeros"
    if same:
        out = size
    else:
        out = tuple((n + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1 for n in size)
    return dict(kind=f"conv{nd}d", c_in=c_in, c_out=c_out, kernel=kernel, stride=stride, padding=padding,
                dilation=dilation, groups=groups, padding_mode=mode, bias=draw(st.booleans()), out=out)


@st.composite
def _norm(draw: Any, family: str, c: int, size: tuple[int, ...]) -> str:
    if family == "seq":
        return draw(st.sampled_from(["none", "ln"]))
    many = max(size) > 1  # instance / group norm (2 groups) need more than one value per group
    gn = ["gn"] if c % 2 == 0 and (many or c > 2) else []
    inorm = ["in"] if many else []
    return draw(st.sampled_from(["none", "bn"] + inorm + gn))


@st.composite
def model_cases(draw: Any, compile_hazards: bool = False) -> dict[str, Any]:
    """A random model plan, batch and step options (see the module docstring).

    ``compile_hazards``: draw mostly what lets a compiled backward reuse a recorded
    tensor's memory: ReLU activations (:data:`COMPILE_ACTS`) and residual branches with
    in-place adds; at most two blocks (a compile costs seconds per layer)."""
    acts = COMPILE_ACTS if compile_hazards else ACTS
    often = st.sampled_from([True, True, False]) if compile_hazards else st.booleans()
    family = draw(st.sampled_from(["conv2d", "conv2d", "conv1d", "seq"]))
    nd = 2 if family == "conv2d" else 1
    blocks: list[dict[str, Any]] = []
    if family == "seq":
        c, size = draw(st.integers(1, 6)), (draw(st.integers(1, 4)),)  # D, (T,)
    else:
        c = draw(st.integers(1, 3))
        size = tuple([draw(st.integers(4, 8 if nd == 2 else 12))] * nd)
    in_channels, in_size = c, size
    for _ in range(draw(st.integers(1, 2 if compile_hazards else 3))):
        if family == "seq":
            h = draw(st.integers(1, 6))
            layer = dict(kind="linear", d_in=c, d_out=h, bias=draw(st.booleans()))
            c_new, size_new = h, size
        else:
            layer = draw(_conv_layer(nd, c, size, same=False))
            c_new, size_new = layer["c_out"], layer["out"]
            if min(size_new) < 1:
                break
        block: dict[str, Any] = dict(layer=layer, norm=draw(_norm(family, c_new, size_new)),
                                     act=draw(st.sampled_from(acts)), pool="none", residual=None)
        c, size = c_new, size_new
        if family != "seq" and min(size) >= 2:
            block["pool"] = draw(st.sampled_from(["none", "none", "max", "avg"]))
            if block["pool"] != "none":
                size = tuple(n // 2 for n in size)
        if draw(often):
            rl = (dict(kind="linear", d_in=c, d_out=c, bias=draw(st.booleans())) if family == "seq"
                  else draw(_conv_layer(nd, c, size, same=True)))
            block["residual"] = dict(layer=rl, norm=draw(_norm(family, c, size)), act=draw(st.sampled_from(acts)),
                                     inplace_add=draw(often), twice=draw(st.booleans()))
        blocks.append(block)
    features = c * (1 if family == "seq" else int(torch.tensor(size).prod()))
    pool = family == "seq" or features > 96 or draw(st.booleans())
    hidden = draw(st.sampled_from([0, 0, 4]))
    return dict(
        family=family, in_channels=in_channels, in_size=in_size, blocks=blocks,
        head=dict(global_pool=pool, features=c if pool else features, hidden=hidden,
                  hidden_act=draw(st.sampled_from(acts)), classes=draw(st.integers(2, 5))),
        m=draw(st.integers(2, 10)), reduction=draw(st.sampled_from(["mean", "sum"])),
        damping=draw(st.sampled_from([0.05, 0.3, 1.0])),
        update_form=draw(st.sampled_from(["auto", "woodbury"])),
        strategy=draw(st.sampled_from(["auto", "auto", "factor", "materialize"])),
        seed=draw(st.integers(0, 2**16)),
    )


# --------------------------------------------------------------------------- modules
def _layer(plan: dict[str, Any], nd: int) -> nn.Module:
    if plan["kind"] == "linear":
        return nn.Linear(plan["d_in"], plan["d_out"], bias=plan["bias"])
    return _CONV[nd](plan["c_in"], plan["c_out"], plan["kernel"], stride=plan["stride"],
                     padding=plan["padding"], dilation=plan["dilation"], groups=plan["groups"],
                     bias=plan["bias"], padding_mode=plan["padding_mode"])


def _norm_module(kind: str, c: int, nd: int) -> nn.Module:
    if kind == "bn":
        bn = _BN[nd](c)
        with torch.no_grad():  # eval mode: make the running statistics non-trivial
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
        return bn
    if kind == "gn":
        return nn.GroupNorm(2, c)
    if kind == "in":
        return _IN[nd](c, affine=True)
    if kind == "ln":
        return nn.LayerNorm(c)
    return nn.Identity()


class Residual(nn.Module):
    """``act(norm(layer(h)) + h)``; ``twice``: ``layer(tanh(layer(h)))`` (two calls)."""

    def __init__(self, plan: dict[str, Any], nd: int, c: int):
        super().__init__()
        self.layer = _layer(plan["layer"], nd)
        self.norm = _norm_module(plan["norm"], c, nd)
        self.act = _act(plan["act"])
        self.inplace_add = plan["inplace_add"]
        self.twice = plan["twice"]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        r = self.layer(h)
        if self.twice:
            r = self.layer(torch.tanh(r))
        r = self.norm(r)
        if self.inplace_add:
            r += h
        else:
            r = r + h
        return self.act(r)


class PlanNet(nn.Module):
    """The model of a plan from :func:`model_cases`; input ``[m, C, *spatial]`` or ``[m, T, D]``."""

    def __init__(self, case: dict[str, Any]):
        super().__init__()
        family = case["family"]
        nd = 2 if family == "conv2d" else 1
        self.seq = family == "seq"
        body: list[nn.Module] = []
        for b in case["blocks"]:
            lp = b["layer"]
            c = lp.get("c_out", lp.get("d_out"))
            body += [_layer(lp, nd), _norm_module(b["norm"], c, nd), _act(b["act"])]
            if b["pool"] != "none":
                body.append(_POOL[(b["pool"], nd)](2))
            if b["residual"] is not None:
                body.append(Residual(b["residual"], nd, c))
        self.body = nn.Sequential(*body)
        head = case["head"]
        self.global_pool = head["global_pool"]
        layers: list[nn.Module] = []
        f = head["features"]
        if head["hidden"]:
            layers += [nn.Linear(f, head["hidden"]), _act(head["hidden_act"])]
            f = head["hidden"]
        layers.append(nn.Linear(f, head["classes"]))
        self.head = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if self.seq:
            h = h.mean(1)
        elif self.global_pool:
            h = h.flatten(2).mean(2)
        else:
            h = h.flatten(1)
        return self.head(h)


def build_model_case(case: dict[str, Any]) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """``(model in float64, x, y)``; the model is in eval mode when it has batch norm."""
    torch.manual_seed(case["seed"])
    model = PlanNet(case).double()
    has_bn = any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in model.modules())
    model.train(not has_bn)
    g = torch.Generator().manual_seed(case["seed"] + 1)
    m = case["m"]
    if case["family"] == "seq":
        shape: tuple[int, ...] = (case["in_size"][0], case["in_channels"])
    else:
        shape = (case["in_channels"], *case["in_size"])
    x = torch.randn(m, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, case["head"]["classes"], (m,), generator=g)
    return model, x, y


def per_sample_grads_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: [m, *shape]}``: gradients of ``cross_entropy(model(x_i), y_i)``, one sample at a
    time (plain autograd). Used instead of ``torch.func.vmap(grad)``, which the fuzz caught
    returning a wrong GroupNorm bias gradient (Conv → ReLU_ → Conv → GroupNorm(2, 2) → ReLU_
    → Linear, float64: off by 0.12 while the loop and the batch gradient agree to 1e-16)."""
    rows: dict[str, list[torch.Tensor]] = {n: [] for n, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        model.zero_grad()
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        for n, p in model.named_parameters():
            rows[n].append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    model.zero_grad()
    return {n: torch.stack(v) for n, v in rows.items()}


_KINKS = {nn.ReLU: (0.0,), nn.LeakyReLU: (0.0,), nn.Hardtanh: (-2.0, 2.0)}


def near_kink(model: nn.Module, x: torch.Tensor, rtol: float = 1e-9) -> bool:
    """Whether an activation of ``model`` gets, on ``x`` (``[m, ...]``), an input within
    ``rtol`` of that call's largest input from a kink without being on it: rounding (one
    order of sums or another, eager or compiled) decides its side, hence the gradient."""
    near = [False]

    def pre(mod: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        v = args[0].detach()
        tol = rtol * v.abs().max().item()
        for k in _KINKS[type(mod)]:
            d = (v - k).abs()
            near[0] |= bool(((d > 0) & (d <= tol)).any())

    hooks = [mod.register_forward_pre_hook(pre) for mod in model.modules() if type(mod) in _KINKS]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return near[0]


def _close(got: torch.Tensor, want: torch.Tensor, w: torch.Tensor, tol: float, floor: float) -> bool:
    """``‖got − want‖ ≤ tol·‖want‖``, allowing the rounding of reading ``u`` as
    ``w_before − w_after`` (a few ulps of ``w``) and an absolute ``floor`` (a layer whose
    gradient is rounding noise, e.g. behind an instance norm of one channel)."""
    return bool((got - want).norm() <= tol * want.norm() + 1e-14 * w.norm() + floor)


def _prepare(model: nn.Module, x: torch.Tensor, case: dict[str, Any]) -> tuple[nn.Module, Any]:
    """``(prepared model, TENGraD)`` with the step options of ``case`` (lr 1, no momentum,
    weight decay or KL clip); ``x``: an input batch ``[m, ...]``."""
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],), loss_reduction=case["reduction"])
    opt = tengrad_fx.TENGraD(prepared, lr=1.0, damping=case["damping"], momentum=0.0, weight_decay=0.0,
                             update_form=case["update_form"], strategy=case["strategy"],
                             curvature_every=1, kl_clip=None)
    return prepared, opt


def _eager_records(model: nn.Module, x: torch.Tensor, y: torch.Tensor, case: dict[str, Any]) -> Snapshot:
    """The records of an eager capture of ``model`` (prepared as :func:`check_step` does)
    on ``x`` (``[m, ...]``), ``y`` (``[m]``)."""
    prepared, _ = _prepare(model, x, case)
    F.cross_entropy(prepared(x), y, reduction=case["reduction"]).backward()
    return snapshot(prepared)


def check_step(case: dict[str, Any], compiled: bool = False, backend: str = "inductor") -> dict[str, int]:
    """One TENGraD step on the model of ``case`` against dense block NGD (float64); a case
    with an activation input at rounding distance from a kink is rejected (:func:`near_kink`).

    ``compiled``: the forward and backward run through ``torch.compile(prepared,
    backend=backend)``, and the records are checked against an eager capture of a copy.
    Returns ``{"covered": layers, "fallback": parameters}`` of the prepared model.
    """
    model, x, y = build_model_case(case)
    assume(not near_kink(copy.deepcopy(model), x))
    ref = copy.deepcopy(model)
    m, alpha = case["m"], case["damping"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*padding='same'.*")
        psg = per_sample_grads_loop(ref, x, y)
        eager = _eager_records(copy.deepcopy(model), x, y, case) if compiled else None
        prepared, opt = _prepare(model, x, case)
        prepared.zero_grad()
        fwd = compile_model(prepared, backend) if compiled else prepared
        F.cross_entropy(fwd(x), y, reduction=case["reduction"]).backward()
        if eager is not None:
            assert_same(snapshot(prepared), eager, RECORD_TOL[x.dtype])
        g = {n: p.grad.detach().clone() for n, p in prepared.named_parameters()}
        before = {n: p.detach().clone() for n, p in prepared.named_parameters()}
        opt.step()
    u = {n: before[n] - p.detach() for n, p in prepared.named_parameters()}
    assert opt.counters["skipped"] == 0

    info = tengrad_fx.get_info(prepared)
    by_layer: dict[str, list[str]] = {}
    for pn, layer in info.covered.items():
        by_layer.setdefault(layer, []).append(pn)
    k = 1.0 if case["reduction"] == "sum" else 1.0 / m
    floor = 1e-13 * torch.cat([t.flatten() for t in g.values()]).norm().item() / min(alpha, 1.0)
    for layer, names in by_layer.items():
        names.sort(key=lambda n: not n.endswith("weight"))
        J = explicit_jacobian(psg, names[0], names[1] if len(names) > 1 else None)
        gv = torch.cat([g[n].flatten() for n in names])
        assert _close(gv, J.sum(0) * k, gv, 1e-10, floor), (layer, "captured gradient is not the batch gradient")
        n = J.shape[1]
        want = torch.linalg.solve(J.T @ J / m + alpha * torch.eye(n, dtype=J.dtype), gv)
        got = torch.cat([u[nm].flatten() for nm in names])
        w = torch.cat([before[nm].flatten() for nm in names])
        assert _close(got, want, w, STEP_TOL, floor), (layer, ((got - want).norm() / want.norm()).item())
    covered = set(info.covered)
    for n in u:
        if n not in covered:
            assert _close(u[n], g[n], before[n], 1e-12, floor), (n, "a fallback parameter must get u = g")
    return {"covered": len(by_layer), "fallback": len(u) - len(covered)}
