"""``fisher="gauss-newton"``: the exact GGN of ``½‖f − y‖²`` against a float64 reference.

Reference per covered layer: ``F = Σ_i J_iᵀJ_i / m`` with ``J_i = ∂f(x_i)/∂θ_layer``
(``[k, n]``, from ``torch.func.vmap(jacrev(...))`` on an unprepared copy), and
``u = solve(F + αI, g)`` with ``g`` the batch gradient of the training loss.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.capture.output_hook import want_output
from testing import output_jacobians_reference

DAMPING = 0.05


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 3))


def cnn() -> nn.Module:
    """Conv, grouped strided conv without bias, Linear with 5 outputs; input ``[B, 3, 8, 8]``."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(4, 4, 3, groups=2, stride=2, bias=False), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 3 * 3, 5))


MODELS = {"mlp": (mlp, (6,)), "cnn": (cnn, (3, 8, 8))}


def _loss(out: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    per_sample = 0.5 * (out - y).pow(2).sum(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def _reference(template: nn.Module, model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str
               ) -> dict[str, torch.Tensor]:
    """``{param name: u}`` for every covered parameter (dense float64 GGN blocks)."""
    ref = copy.deepcopy(template)
    ref.load_state_dict(model.state_dict())
    ref.zero_grad()
    _loss(ref(x), y, reduction).backward()
    g = {n: p.grad for n, p in ref.named_parameters()}
    jac = output_jacobians_reference(ref, x)
    m = x.shape[0]
    layers: dict[str, list[str]] = {}
    for pn, layer in sorted(tengrad_fx.get_info(model).covered.items(), key=lambda kv: not kv[0].endswith("weight")):
        layers.setdefault(layer, []).append(pn)
    out = {}
    for names in layers.values():
        J = torch.cat([jac[n].flatten(2) for n in names], 2)  # [m, k, n]
        Fb = torch.einsum("ikp,ikq->pq", J, J) / m
        gv = torch.cat([g[n].flatten() for n in names])
        u = torch.linalg.solve(Fb + DAMPING * torch.eye(Fb.shape[0], dtype=Fb.dtype), gv)
        off = 0
        for n in names:
            out[n] = u[off: off + g[n].numel()].view_as(g[n])
            off += g[n].numel()
    return out


@pytest.mark.parametrize("kind,strategy,reduction,compile", [
    ("mlp", "auto", "mean", False), ("mlp", "factor", "sum", False), ("mlp", "materialize", "mean", False),
    ("mlp", "auto", "mean", "eager"),
    ("cnn", "auto", "mean", False), ("cnn", "factor", "mean", False), ("cnn", "materialize", "sum", False),
])
def test_gauss_newton_equals_dense_ggn(kind: str, strategy: str, reduction: str, compile: bool | str) -> None:
    torch.manual_seed(0)
    net = MODELS[kind][0]().double()
    template = copy.deepcopy(net)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, *MODELS[kind][1], generator=gen, dtype=torch.float64)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],), loss_reduction=reduction)
    opt = TENGraD(model, lr=1.0, damping=DAMPING, momentum=0.0, weight_decay=0.0, fisher="gauss-newton",
                  strategy=strategy, compile=compile, curvature_every=1, kl_clip=None)
    for step in range(2):  # the second step checks that the first step's records were released
        x = torch.randn(7, *MODELS[kind][1], generator=gen, dtype=torch.float64)
        k = model(x[:1]).shape[1]
        y = torch.randn(7, k, generator=gen, dtype=torch.float64)
        ref = _reference(template, model, x, y, reduction)
        out = model(x)
        opt.zero_grad()
        opt.mc_capture(out)
        _loss(out, y, reduction).backward()
        # the real backward is untouched by the k G-only passes: p.grad is the loss gradient
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for n, u_ref in ref.items():
            u = before[n] - dict(model.named_parameters())[n].detach()
            err = ((u - u_ref).norm() / u_ref.norm()).item()
            assert err <= 1e-8, f"step {step}, {n}: rel err {err:.2e}"
    assert opt.counters["skipped"] == 0


def test_gauss_newton_k_above_16_points_to_mc() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 17))
    x = torch.randn(5, 4)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=0.1, damping=0.1, fisher="gauss-newton")
    out = model(x)
    with pytest.raises(ValueError, match=r"k = 17 .*fisher='mc'"):
        opt.mc_capture(out)


def test_gauss_newton_without_capture_call_raises() -> None:
    model = tengrad_fx.prepare(mlp(), example_inputs=(torch.randn(2, 6),))
    opt = TENGraD(model, lr=0.1, damping=0.1, fisher="gauss-newton")
    want_output(tengrad_fx.get_info(model).store.key, None)  # no output hook: no implicit capture
    _loss(model(torch.randn(5, 6)), torch.randn(5, 3), "mean").backward()
    with pytest.raises(RuntimeError, match="gauss-newton.*mc_capture"):
        opt.step()


def test_gauss_newton_rows_of_a_part_of_the_global_batch() -> None:
    """``part=1`` of ``parts=2`` parts of 3 samples: the records keep this part's share of the
    global batch's first ``samples`` (``k = 4``: its first 1 sample; ``k = 2``: 0 rows, of the
    other parts' trailing shapes), the rows of the whole part's records."""
    from tengrad_fx.optim.tengrad.gauss_newton import gauss_newton_capture
    torch.manual_seed(0)
    model = tengrad_fx.prepare(mlp(), example_inputs=(torch.randn(2, 6),))
    store = tengrad_fx.get_info(model).store
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    x = torch.randn(3, 6, dtype=torch.float32)

    def rows(samples: int | None) -> dict[int, torch.Tensor]:
        gauss_newton_capture(store, model(x), weights, "mean", samples=samples, part=1, parts=2)
        got = {site: recs[0].G for site, recs in store.records.items()}
        assert not store.parts
        return got

    full = rows(None)  # row j·3 + i: output j of sample i
    for k, held in ((4, 1), (2, 0), (6, 3)):
        for site, g in rows(k).items():
            want = full[site].reshape(3, 3, *full[site].shape[1:])[:, :held].reshape(3 * held, *full[site].shape[1:])
            assert torch.equal(g, want), (k, site)


@pytest.mark.parametrize("part", [0, 1])
def test_gauss_newton_rows_of_a_part_under_accumulation(part: int) -> None:
    """Part ``part`` of 2, two accumulated micro-batches of 3 samples: the global batch is
    micro-batch 0 of both parts, then micro-batch 1 of both (positions ``2·3·j + part·3``
    on), so each micro-batch keeps the output rows of its first
    ``min(3, max(0, samples − 6·j − 3·part))`` samples, those of its whole records (a
    micro-batch past the first ``samples`` runs no backward and has none)."""
    from tengrad_fx.optim.tengrad.gauss_newton import gauss_newton_capture
    torch.manual_seed(0)
    model = tengrad_fx.prepare(mlp(), example_inputs=(torch.randn(2, 6),))
    store = tengrad_fx.get_info(model).store
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    xs = [torch.randn(3, 6, dtype=torch.float64) for _ in range(2)]
    model.double()

    def rows(samples: int | None) -> list[dict[int, list[torch.Tensor]]]:
        """Each micro-batch's records (``G`` and ``I`` per site) after accumulating both."""
        store.clear()
        model.zero_grad(set_to_none=True)
        for x in xs:
            out = model(x)
            gauss_newton_capture(store, out, weights, "mean", samples=samples, part=part, parts=2)
            _loss(out, torch.zeros_like(out), "mean").backward()  # the gradients accumulate
        return [{site: [recs[0].G, recs[0].I] for site, recs in mb.items()} for mb in [*store.parts, store.records]
                if mb]

    full = rows(None)  # per micro-batch, row j·3 + i: output j of sample i
    assert len(full) == 2
    for samples in (1, 2, 4, 5, 6, 7, 8, 9, 10, 12):
        held = [min(3, max(0, samples - 6 * j - 3 * part)) for j in range(2)]
        got = rows(samples)
        assert len(got) == (2 if samples > 6 else 1), samples  # micro-batch 1 only with samples past the first 6
        for j, mb in enumerate(got):
            for site, tensors in mb.items():
                for t, t_full in zip(tensors, full[j][site]):
                    want = t_full.reshape(3, 3, *t_full.shape[1:])[:, :held[j]].reshape(-1, *t_full.shape[1:])
                    assert torch.equal(t, want), (samples, j, site)
