"""Dense float64 references for TENGraD steps on small float64 models.

``mlp``: Linear 6→16→12→4; ``cnn``: Conv2d(3→4), grouped Conv2d (groups 2, stride 2, no
bias), Linear(36→4) on ``[B, 3, 8, 8]``; ``cnn_small_maps``: convolutions down to 2×2 and
1×1 maps. :func:`setup` returns an unprepared template, the prepared model and a
:class:`TENGraD` with ``lr=1, momentum=0, weight_decay=0``, so a step's parameter change
is ``-u`` (:func:`step_delta`); :func:`dense_u` is the reference ``u = solve(JᵀJ/m + αI, g)``
per covered layer.
"""
from __future__ import annotations

import copy
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD

from .oracle import dense_layer_updates

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LMStep = tuple[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor],
               dict[str, list[torch.Tensor]], dict[str, str]]
TOL = 1e-8


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def mc_labels(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """The labels one MC draw after ``opt.seed_mc(seed)`` gives ``logits`` (``[*, c]``, one
    process), written independently of the library: a uniform per position from
    ``torch.Generator().manual_seed(seed)`` in the logits' precision (at least float32),
    the first class whose cumulative softmax exceeds it."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    u = torch.rand(logits.shape[:-1], dtype=dtype, generator=torch.Generator().manual_seed(seed))
    cdf = torch.softmax(logits.detach().to(dtype), -1).cumsum(-1)
    return (cdf <= u.unsqueeze(-1)).sum(-1).clamp(max=logits.shape[-1] - 1)


# --------------------------------------------------------------------------- models / data
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 4)).double()


def cnn() -> nn.Module:
    """Conv, grouped conv (groups=2, stride 2, no bias), Linear; input ``[B, 3, 8, 8]``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
        nn.Conv2d(4, 4, 3, groups=2, stride=2, bias=False), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 4),
    ).double()


def cnn_small_maps() -> nn.Module:
    """Convolutions down to 2×2 and 1×1 maps on ``[B, 3, 8, 8]``: 4×4 (16 positions), 2×2
    (stride 2), two equal 2×2 → 2×2 (one stack), 1×1 (kernel 2, stride 2, no bias), Linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1), nn.Tanh(),
        nn.Conv2d(6, 6, 3, padding=1), nn.Tanh(),
        nn.Conv2d(6, 5, 2, stride=2, bias=False), nn.Tanh(),
        nn.Flatten(), nn.Linear(5, 4),
    ).double()


class TinyLM(nn.Module):
    """Embedding (vocab 7, padding index 0), a transposed Linear (Hugging Face's ``Conv1D``),
    and the output Linear (with a bias), its weight tied to the embedding's unless
    ``tied=False``; logits ``[B, S, 7]``."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D
        torch.manual_seed(1)
        self.emb = nn.Embedding(7, 5, padding_idx=0)
        self.mix = Conv1D(5, 5)
        self.head = nn.Linear(5, 7)
        if tied:
            self.head.weight = self.emb.weight
        nn.init.normal_(self.mix.weight, std=0.5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(idx))))


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (3, 8, 8)), "cnn_small_maps": (cnn_small_maps, (3, 8, 8))}


def batch(kind: str, m: int, seed: int, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, *MODELS[kind][1], generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (m,), generator=g)
    return x, y


def setup(kind: str, **opt_kw) -> tuple[nn.Module, nn.Module, TENGraD]:
    """(pristine unprepared template, prepared model, optimizer)."""
    net = MODELS[kind][0]()
    template = copy.deepcopy(net)
    x, _ = batch(kind, 2, 99)
    model = tengrad_fx.prepare(net, example_inputs=(x,))
    kw = dict(lr=1.0, damping=0.05, momentum=0.0, weight_decay=0.0, curvature_every=1, kl_clip=None)
    kw.update(opt_kw)
    return template, model, TENGraD(model, **kw)


def snapshot(template: nn.Module, model: nn.Module) -> nn.Module:
    """An unprepared copy holding ``model``'s current parameters."""
    ref = copy.deepcopy(template)
    ref.load_state_dict(model.state_dict())
    return ref


def layer_params(model: nn.Module) -> dict[str, list[str]]:
    """Covered layer name -> its parameter names (weight first)."""
    out: dict[str, list[str]] = {}
    for pn, layer in sorted(tengrad_fx.get_info(model).covered.items(), key=lambda kv: not kv[0].endswith("weight")):
        out.setdefault(layer, []).append(pn)
    return out


def covered_and_biases(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``({param name: its layer}, {weight name: its layer's bias name})`` of the covered layers."""
    layers = layer_params(model)
    covered = {pn: lay for lay, names in layers.items() for pn in names}
    return covered, {names[0]: names[1] for names in layers.values() if len(names) == 2}


def full_grad(ref: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn) -> dict[str, torch.Tensor]:
    ref.zero_grad()
    loss_fn(ref(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def dense_u(J_ref: nn.Module, xJ: torch.Tensor, yJ: torch.Tensor, lossJ: LossFn, g: dict[str, torch.Tensor],
            damping: float, layers: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """``{param name: u}``, ``u = solve(JᵀJ/m + αI, g)`` per layer (``layers``: name -> params)."""
    covered = {pn: lay for lay, names in layers.items() for pn in names}
    return dense_layer_updates(J_ref, xJ, yJ, lossJ, g, damping, covered)


def step_delta(model: nn.Module, opt: TENGraD) -> dict[str, torch.Tensor]:
    """``{name: p_before - p_after}`` over one ``opt.step()``; with lr=1 that is ``u``."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return {n: (before[n] - p.detach()) / opt.param_groups[0]["lr"] for n, p in model.named_parameters()}


def forward_backward(model: nn.Module, opt: TENGraD, x, y, loss_fn: LossFn = F.cross_entropy) -> torch.Tensor:
    out = model(x)
    loss = loss_fn(out, y)
    opt.zero_grad()
    loss.backward()
    return out


def recorded_step(template: nn.Module, model: nn.Module, opt: TENGraD, seed: int,
                  history: dict[str, list[torch.Tensor]]) -> tuple[nn.Module, torch.Tensor, torch.Tensor,
                                                                   dict[str, torch.Tensor]]:
    """The MLP's batch ``seed`` (m = 8) through ``model``'s forward and backward:
    ``(reference model before the step, x, y, g)``, ``g`` also appended to ``history``."""
    x, y = batch("mlp", 8, seed)
    ref_model = snapshot(template, model)
    forward_backward(model, opt, x, y)
    g = full_grad(ref_model, x, y, F.cross_entropy)
    for n, gn in g.items():
        history.setdefault(n, []).append(gn)
    return ref_model, x, y, g


def lm_steps(steps: int, tied: bool = True, **opt_kw) -> Iterator[LMStep]:
    """``steps`` steps of :class:`TinyLM` in float64 (``T = 1``, lr 1, no momentum, weight decay or
    KL clip unless ``opt_kw`` says otherwise; ``opt_kw`` the other options; batches ``[6, 4]``):
    per step ``(reference model before it, x, y, g, the update u, the gradient history so far,
    the covered parameters)``."""
    net = TinyLM(tied).double()
    template = copy.deepcopy(net)
    gen = torch.Generator().manual_seed(3)
    model = tengrad_fx.prepare(net, example_inputs=(torch.randint(0, 7, (2, 4), generator=gen),))
    kw = dict(lr=1.0, momentum=0.0, weight_decay=0.0, curvature_every=1, kl_clip=None)
    opt = TENGraD(model, **{**kw, **opt_kw})
    covered = tengrad_fx.get_info(model).covered
    history: dict[str, list[torch.Tensor]] = {}
    for _ in range(steps):
        x, y = torch.randint(0, 7, (6, 4), generator=gen), torch.randint(0, 7, (6, 4), generator=gen)
        ref_model = snapshot(template, model)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        g = full_grad(ref_model, x, y, lm_loss)
        for n, gn in g.items():
            history.setdefault(n, []).append(gn)
        yield ref_model, x, y, g, step_delta(model, opt), history, covered


def assert_matches(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = TOL) -> None:
    assert ref, "no covered layer"
    for k, u_ref in ref.items():
        r = rel(delta[k], u_ref)
        assert r <= tol, f"{k}: rel err {r:.2e}"


def assert_graphs_match_eager(device: str, steps: int = 7, **opt_kw) -> None:
    """The MLP trained ``steps`` steps in float32 on ``device`` with ``cuda_graph=True`` equals
    ``cuda_graph=False`` (``opt_kw``: the other options): on a CPU the graph runner runs
    eagerly, bit for bit; on CUDA the reuse steps replay, to float32 rounding."""
    def run(graph: bool) -> tuple[dict[str, torch.Tensor], TENGraD]:
        _, model, opt = setup("mlp", cuda_graph=graph, **opt_kw)
        model.to(device, torch.float32)
        for t in range(steps):
            x, y = batch("mlp", 8, t)
            forward_backward(model, opt, x.to(device, torch.float32), y.to(device))
            opt.step()
        return {n: p.detach().cpu() for n, p in model.named_parameters()}, opt

    (eager, _), (graphed, opt) = run(False), run(True)
    if device == "cpu":
        assert all(torch.equal(eager[n], graphed[n]) for n in eager)
    else:
        assert opt.graph_runner.graphs.replays > 0
        assert all(torch.allclose(eager[n], graphed[n], rtol=1e-5, atol=1e-6) for n in eager)
