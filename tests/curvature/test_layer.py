"""Per-sample gradients of every covered layer against the torch.func oracle.

The prepared model shares its Parameters with the original one, so the oracle
(``testing.per_sample_grads_reference``) runs on the ORIGINAL module and each covered
layer is matched to its parameter names by identity.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from testing import explicit_jacobian, per_sample_grads_reference

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- models
class _Seq(nn.Module):
    """Linear on ``(B, T, D)``: token-wise Linear, tanh, Linear, mean over tokens."""

    def __init__(self, d: int = 6, h: int = 7, k: int = 4, bias: bool = True):
        super().__init__()
        self.inp = nn.Linear(d, h, bias=bias)
        self.out = nn.Linear(h, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x))).mean(1)


class _Twice(nn.Module):
    """One conv module called twice per forward (its calls are extra positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(torch.tanh(self.conv(x)))
        return self.head(h.flatten(1))


def c3f1_small() -> tuple[nn.Module, tuple[int, ...]]:
    """3C1F-like: conv 1→8→8→8 (3×3 pad 1), MaxPool2d(3), Linear(8·4·4→16), Linear(16→10)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
        nn.Linear(8 * 4 * 4, 16), nn.ReLU(), nn.Linear(16, 10),
    ), (1, 12, 12)


def grouped() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, padding=1, groups=2), nn.Tanh(), nn.Flatten(), nn.Linear(6 * 5 * 5, 10),
    ), (4, 5, 5)


def depthwise() -> tuple[nn.Module, tuple[int, ...]]:
    """groups = c_in, channel multiplier 2."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1, groups=3), nn.Tanh(), nn.Conv2d(6, 4, 1), nn.Tanh(),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 10),
    ), (3, 6, 6)


def strided_dilated() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=2, dilation=2), nn.Tanh(),
        nn.Conv2d(4, 4, (3, 2), stride=(1, 2), padding=(1, 0), dilation=(1, 2)), nn.Tanh(),
        nn.Conv2d(4, 6, 2, stride=2, padding="valid", groups=2), nn.Tanh(),
        nn.Flatten(), nn.LazyLinear(10),
    ), (3, 11, 12)


def padding_modes() -> tuple[nn.Module, tuple[int, ...]]:
    """'same' (asymmetric for an even kernel) and non-zero padding modes (pre-padded input)."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 4, padding="same"), nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"), nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=(1, 2), padding_mode="circular"), nn.Tanh(),
        nn.Conv2d(3, 2, 3, padding=1, padding_mode="replicate", dilation=(1, 2)), nn.Tanh(),
        nn.Flatten(), nn.LazyLinear(10),
    ), (2, 6, 7)


def conv1d() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv1d(3, 4, 5, stride=2, padding=2), nn.Tanh(), nn.Conv1d(4, 4, 3, dilation=2, groups=2),
        nn.Tanh(), nn.Flatten(), nn.LazyLinear(10),
    ), (3, 13)


def conv3d() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv3d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv3d(3, 4, (2, 3, 1), stride=(1, 2, 1), groups=1),
        nn.Tanh(), nn.Flatten(), nn.LazyLinear(10),
    ), (2, 4, 5, 3)


def no_bias() -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=4, bias=False),
        nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 8, bias=False), nn.Tanh(), nn.Linear(8, 10, bias=False),
    ), (2, 6, 6)


def sequence() -> tuple[nn.Module, tuple[int, ...]]:
    return _Seq(), (5, 6)


def sequence_no_bias() -> tuple[nn.Module, tuple[int, ...]]:
    return _Seq(bias=False), (3, 6)


def called_twice() -> tuple[nn.Module, tuple[int, ...]]:
    return _Twice(), (3, 6, 6)


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[int, ...]]]] = {
    "3c1f_small": c3f1_small, "grouped": grouped, "depthwise": depthwise,
    "strided_dilated": strided_dilated, "padding_modes": padding_modes, "conv1d": conv1d,
    "conv3d": conv3d, "no_bias": no_bias, "sequence": sequence, "sequence_no_bias": sequence_no_bias,
    "called_twice": called_twice,
}
N_COVERED = {"3c1f_small": 5, "grouped": 2, "depthwise": 3, "strided_dilated": 4, "padding_modes": 5,
             "conv1d": 3, "conv3d": 3, "no_bias": 4, "sequence": 2, "sequence_no_bias": 2,
             "called_twice": 2}


def build(name: str, dtype: torch.dtype, m: int = 5, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model, shape = MODELS[name]()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, *shape, generator=g, dtype=torch.float64)
    model(x[:1].float())  # materialize LazyLinear
    model = model.to(torch.float64)
    y = torch.randint(0, 10 if name not in ("sequence", "sequence_no_bias", "called_twice") else 4,
                      (m,), generator=g)
    return model.to(dtype), x.to(dtype), y


def check_layers(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn, *,  # type: ignore[no-untyped-def]
                 reduction: str = "mean", batch_loss=None, oracle_model: Optional[nn.Module] = None,
                 oracle_x: Optional[torch.Tensor] = None, tol: float, n_covered: Optional[int] = None,
                 in_backward: bool = False):
    """Prepare, one forward/backward, compare every covered layer with the oracle.

    ``in_backward``: mark every site in ``store.jacobian_sites`` so the backward op
    materializes the per-sample gradients ``P`` itself (no ``I``/``G`` kept).
    """
    ref_model = model if oracle_model is None else oracle_model
    ref = per_sample_grads_reference(ref_model, x if oracle_x is None else oracle_x, loss_fn, y)
    names = _names(model)
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],), loss_reduction=reduction)
    info = tengrad_fx.get_info(prepared)
    if in_backward:
        info.store.jacobian_sites = {s for spec in info.layers for s in spec.sites}
    out = prepared(x)
    (batch_loss or loss_fn)(out, y).backward()
    layers = tengrad_fx.covered_layers(prepared)
    if n_covered is not None:
        assert len(layers) == n_covered, [l.name for l in layers]
    for layer in layers:
        assert layer.materialized == in_backward
        dW, db = layer.per_sample_grads()
        wn = names[id(layer.weight)]
        assert dW.shape == (x.shape[0], *layer.weight.shape)
        assert dW.dtype == x.dtype
        assert rel(dW, ref[wn].to(dW.dtype)) <= tol, (layer.name, rel(dW, ref[wn].to(dW.dtype)))
        if layer.bias is None:
            assert db is None
        else:
            bn = names[id(layer.bias)]
            assert db is not None and db.shape == (x.shape[0], *layer.bias.shape)
            assert rel(db, ref[bn].to(db.dtype)) <= tol, (layer.name, rel(db, ref[bn].to(db.dtype)))
    return prepared, layers, ref, names


@pytest.mark.parametrize("in_backward", [False, True], ids=["IG", "P"])
@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_grads_float64(name: str, in_backward: bool) -> None:
    model, x, y = build(name, torch.float64)
    check_layers(model, x, y, F.cross_entropy, tol=TOL[torch.float64], n_covered=N_COVERED[name],
                 in_backward=in_backward)


@pytest.mark.parametrize("mode", ["unfold", "grouped"])
@pytest.mark.parametrize("name", ["3c1f_small", "grouped", "depthwise", "strided_dilated", "padding_modes",
                                  "conv1d", "conv3d", "called_twice"])
def test_per_sample_grads_forced_method_float64(name: str, mode: str, monkeypatch) -> None:
    """``TENGRAD_FX_PER_SAMPLE_CONV=unfold|grouped`` (every Conv1d/2d by unfold + one bmm,
    or every conv by the grouped convolution; the default ``auto`` is the rule of
    :mod:`tengrad_fx.capture.per_sample_conv`, covered by the tests above): the
    materialized P equals torch.func's per-sample grads."""
    from tengrad_fx.capture import per_sample_conv as psc
    monkeypatch.setattr(psc, "PER_SAMPLE_CONV", mode)
    calls = [0]
    real = psc._unfold_bmm

    def spy(*a, **k):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(psc, "_unfold_bmm", spy)
    model, x, y = build(name, torch.float64)
    check_layers(model, x, y, F.cross_entropy, tol=TOL[torch.float64], n_covered=N_COVERED[name], in_backward=True)
    assert (calls[0] > 0) == (mode == "unfold" and name != "conv3d")


@pytest.mark.parametrize("name", ["3c1f_small", "grouped", "depthwise", "strided_dilated", "conv1d",
                                  "conv3d", "no_bias", "sequence", "called_twice"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["IG", "P"])
def test_per_sample_grads_float32(name: str, in_backward: bool) -> None:
    """float32 capture against the float64 oracle on the same weights."""
    model64, x64, y = build(name, torch.float64)
    model32 = copy.deepcopy(model64).float()
    check_layers(model32, x64.float(), y, F.cross_entropy, oracle_model=model64, oracle_x=x64,
                 tol=TOL[torch.float32], n_covered=N_COVERED[name], in_backward=in_backward)


@pytest.mark.parametrize("name", ["3c1f_small", "depthwise", "sequence", "called_twice"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["IG", "P"])
def test_per_sample_grads_sum_reduction(name: str, in_backward: bool) -> None:
    model, x, y = build(name, torch.float64)

    def summed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, t, reduction="sum")

    check_layers(model, x, y, summed, reduction="sum", tol=TOL[torch.float64], n_covered=N_COVERED[name],
                 in_backward=in_backward)


def test_mean_vs_sum_reduction_scale() -> None:
    """The same batch with mean- and sum-reduced losses gives the same per-sample grads."""
    outs = []
    for red in ("mean", "sum"):
        model, x, y = build("3c1f_small", torch.float64)
        prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],), loss_reduction=red)
        F.cross_entropy(prepared(x), y, reduction=red).backward()
        outs.append([l.per_sample_grads()[0] for l in tengrad_fx.covered_layers(prepared)])
    for a, b in zip(*outs):
        assert rel(a, b) <= 1e-12


@pytest.mark.parametrize("name", ["3c1f_small", "depthwise", "strided_dilated", "padding_modes",
                                  "conv3d", "no_bias", "sequence", "called_twice"])
@pytest.mark.parametrize("in_backward", [False, True], ids=["IG", "P"])
def test_gram_jvp_vjp_against_explicit_jacobian(name: str, in_backward: bool) -> None:
    """Every strategy's Gram, Jv and Jᵀc against J built from the oracle (float64), from
    the stored I, G or from the per-sample gradients materialized in backward."""
    model, x, y = build(name, torch.float64, m=4)
    _, layers, ref, names = check_layers(model, x, y, F.cross_entropy, tol=TOL[torch.float64],
                                         in_backward=in_backward)
    g = torch.Generator().manual_seed(7)
    for layer in layers:
        bn = names[id(layer.bias)] if layer.bias is not None else None
        J = explicit_jacobian(ref, names[id(layer.weight)], bn)
        assert rel(layer.jacobian(), J) <= 1e-10
        K = J @ J.T
        for how in ("factor", "materialize", "auto"):
            Kh = layer.gram(how)
            assert Kh.shape == (4, 4) and Kh.dtype == torch.float64
            assert rel(Kh, K) <= 1e-10, (layer.name, how, rel(Kh, K))
        vw = torch.randn(layer.weight.shape, generator=g, dtype=torch.float64)
        vb = None if layer.bias is None else torch.randn(layer.bias.shape, generator=g, dtype=torch.float64)
        v = vw.flatten() if vb is None else torch.cat([vw.flatten(), vb])
        assert rel(layer.jvp(vw, vb), J @ v) <= 1e-10
        c = torch.randn(4, generator=g, dtype=torch.float64)
        gw, gb = layer.vjp(c)
        Jc = J.T @ c
        n_w = layer.weight.numel()
        assert gw.shape == layer.weight.shape
        assert rel(gw.flatten(), Jc[:n_w]) <= 1e-10
        if layer.bias is None:
            assert gb is None
        else:
            assert gb is not None and gb.shape == layer.bias.shape
            assert rel(gb, Jc[n_w:]) <= 1e-10


def test_batch_gradient_is_sum_of_per_sample() -> None:
    """Σ_i (per-sample grad)/m equals the parameter's .grad of the mean loss."""
    model, x, y = build("depthwise", torch.float64)
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    F.cross_entropy(prepared(x), y).backward()
    for layer in tengrad_fx.covered_layers(prepared):
        dW, db = layer.per_sample_grads()
        assert rel(dW.mean(0), layer.weight.grad) <= 1e-12
        if db is not None:
            assert rel(db.mean(0), layer.bias.grad) <= 1e-12


def test_new_step_replaces_capture() -> None:
    """After ``zero_grad()`` a second forward/backward (another batch size) replaces the first
    capture (without it the two accumulate: ``tests/optim/test_accumulation.py``)."""
    model, x, y = build("3c1f_small", torch.float64, m=6)
    ref = per_sample_grads_reference(model, x[:3], F.cross_entropy, y[:3])
    names = _names(model)
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    F.cross_entropy(prepared(x), y).backward()
    assert all(l.m == 6 for l in tengrad_fx.covered_layers(prepared))
    prepared.zero_grad()
    F.cross_entropy(prepared(x[:3]), y[:3]).backward()
    for layer in tengrad_fx.covered_layers(prepared):
        assert layer.m == 3
        dW, _ = layer.per_sample_grads()
        assert rel(dW, ref[names[id(layer.weight)]]) <= 1e-10


@pytest.mark.parametrize("in_backward", [False, True], ids=["IG", "P"])
def test_results_are_detached(in_backward: bool) -> None:
    """Captured tensors hold no autograd graph, and no curvature result requires grad."""
    model, x, y = build("3c1f_small", torch.float64)
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    if in_backward:
        info.store.jacobian_sites = {s for spec in info.layers for s in spec.sites}
    F.cross_entropy(prepared(x), y).backward()
    for site, recs in info.store.records.items():
        for r in recs:
            for t in (r.I, r.G, r.P, r.Gsum):
                assert t is None or (not t.requires_grad and t.grad_fn is None), site
    for layer in tengrad_fx.covered_layers(prepared):
        vw = torch.ones_like(layer.weight)
        outs = [layer.gram("factor"), layer.gram("materialize"), *layer.per_sample_grads(),
                layer.jvp(vw), *layer.vjp(torch.ones(x.shape[0], dtype=x.dtype))]
        for t in outs:
            assert t is None or not t.requires_grad, layer.name
