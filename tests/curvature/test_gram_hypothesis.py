"""Property tests: one covered layer, random configuration, against the explicit J.

The model is the layer alone; the loss is a fixed nonlinear readout outside it,
``ℓ_i = Σ tanh(out_i) ⊙ R_i`` with a fixed random ``R`` (so ``G`` is non-trivial and
only the layer under test is covered). The oracle ``J`` comes from torch.func
(``testing.per_sample_grads_reference`` / ``explicit_jacobian``). float64, rel. tol 1e-9.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tengrad_fx
from testing import explicit_jacobian, per_sample_grads_reference

TOL = 1e-9
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _readout(out: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Σ tanh(out) ⊙ R (one sample's loss when called on one sample)."""
    return (torch.tanh(out) * R).sum()


def _close(a: torch.Tensor, b: torch.Tensor, scale: float) -> bool:
    return bool((a - b).norm() <= TOL * scale)


def check_layer(layer: nn.Module, x: torch.Tensor, reduction: str, seed: int, x_grad: bool = False,
                in_backward: bool = False) -> None:
    """Prepare ``layer`` alone, one capture, every curvature op against explicit J.

    ``x_grad``: the input requires grad (the backward op then also computes the input grad).
    ``in_backward``: the site is in ``store.jacobian_sites``, so the backward op keeps the
    per-sample gradients ``P`` instead of ``I``/``G``.
    """
    model = nn.Sequential(layer).to(torch.float64)
    m = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out_shape = model(x).shape
    R = torch.randn(out_shape, generator=g, dtype=torch.float64)

    ref = per_sample_grads_reference(model, x, _readout, R)
    J = explicit_jacobian(ref, "0.weight", "0.bias" if layer.bias is not None else None)
    K = J @ J.T
    nJ = J.norm().item()

    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],), loss_reduction=reduction)
    if in_backward:
        info = tengrad_fx.get_info(prepared)
        info.store.jacobian_sites = set(info.layers[0].sites)
    loss = _readout(prepared(x.detach().requires_grad_(x_grad)), R)
    (loss / m if reduction == "mean" else loss).backward()
    layers = tengrad_fx.covered_layers(prepared)
    assert len(layers) == 1
    cl = layers[0]
    assert cl.m == m and cl.materialized == in_backward

    dW, db = cl.per_sample_grads()
    assert dW.shape == (m, *layer.weight.shape)
    assert _close(dW, ref["0.weight"], ref["0.weight"].norm().item())
    if layer.bias is None:
        assert db is None
    else:
        assert db is not None and _close(db, ref["0.bias"], ref["0.bias"].norm().item())

    for how in ("factor", "materialize", "auto"):
        Kh = cl.gram(how)
        assert Kh.shape == (m, m) and Kh.dtype == torch.float64
        assert _close(Kh, K, K.norm().item()), (how, ((Kh - K).norm() / K.norm()).item())

    vw = torch.randn(layer.weight.shape, generator=g, dtype=torch.float64)
    vb = None if layer.bias is None else torch.randn(layer.bias.shape, generator=g, dtype=torch.float64)
    v = vw.flatten() if vb is None else torch.cat([vw.flatten(), vb])
    Jv = cl.jvp(vw, vb)
    assert Jv.shape == (m,)
    assert _close(Jv, J @ v, nJ * v.norm().item())

    c = torch.randn(m, generator=g, dtype=torch.float64)
    gw, gb = cl.vjp(c)
    Jc = J.T @ c
    n_w = layer.weight.numel()
    assert gw.shape == layer.weight.shape
    assert _close(gw.flatten(), Jc[:n_w], nJ * c.norm().item())
    if layer.bias is None:
        assert gb is None
    else:
        assert gb is not None and gb.shape == layer.bias.shape
        assert _close(gb, Jc[n_w:], nJ * c.norm().item())


# --------------------------------------------------------------------------- Linear
@st.composite
def linear_cases(draw: Any) -> dict[str, Any]:
    return dict(
        d_in=draw(st.integers(1, 9)), d_out=draw(st.integers(1, 9)),
        seq=tuple(draw(st.lists(st.integers(1, 4), max_size=2))),
        bias=draw(st.booleans()), m=draw(st.integers(1, 5)),
        reduction=draw(st.sampled_from(["sum", "mean"])), seed=draw(st.integers(0, 2**16)),
        x_grad=draw(st.booleans()), in_backward=draw(st.booleans()),
    )


@settings(max_examples=80, **SETTINGS)
@given(linear_cases())
def test_linear(case: dict[str, Any]) -> None:
    torch.manual_seed(case["seed"])
    layer = nn.Linear(case["d_in"], case["d_out"], bias=case["bias"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["m"], *case["seq"], case["d_in"], generator=g, dtype=torch.float64)
    check_layer(layer, x, case["reduction"], case["seed"], case["x_grad"], case["in_backward"])


# --------------------------------------------------------------------------- Conv1d / Conv2d
@st.composite
def conv_cases(draw: Any) -> dict[str, Any]:
    nd = draw(st.sampled_from([1, 2]))
    groups = draw(st.integers(1, 3))
    c_in = groups * draw(st.integers(1, 3))
    c_out = groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    pad_kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    if pad_kind == "same":  # PyTorch allows 'same' only with stride 1
        stride: tuple[int, ...] = (1,) * nd
    else:
        stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    padding: Any
    if pad_kind == "int":
        padding = draw(st.integers(0, 3))
        pads = (padding,) * nd
    elif pad_kind == "tuple":
        padding = tuple(draw(st.integers(0, 3)) for _ in range(nd))
        pads = padding
    elif pad_kind == "same":
        padding = "same"
        pads = tuple(-(-(dl * (k - 1)) // 2) for k, dl in zip(kernel, dilation))
    else:
        padding = "valid"
        pads = (0,) * nd
    padding_mode = "zeros"
    if pad_kind != "valid" and any(pads):
        padding_mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    spatial = []
    for k, dl, p in zip(kernel, dilation, pads):
        lo = max(1, dl * (k - 1) + 1 - 2 * p, p + 1)  # >= one output; reflect needs p < n
        spatial.append(draw(st.integers(lo, lo + (5 if nd == 2 else 8))))
    return dict(
        nd=nd, c_in=c_in, c_out=c_out, kernel=kernel, stride=stride, padding=padding,
        dilation=dilation, groups=groups, padding_mode=padding_mode, bias=draw(st.booleans()),
        spatial=tuple(spatial), m=draw(st.integers(1, 5)),
        reduction=draw(st.sampled_from(["sum", "mean"])), seed=draw(st.integers(0, 2**16)),
        x_grad=draw(st.booleans()), in_backward=draw(st.booleans()),
    )


@settings(max_examples=180, **SETTINGS)
@given(conv_cases())
def test_conv(case: dict[str, Any]) -> None:
    torch.manual_seed(case["seed"])
    cls = nn.Conv1d if case["nd"] == 1 else nn.Conv2d
    layer = cls(case["c_in"], case["c_out"], case["kernel"], stride=case["stride"],
                padding=case["padding"], dilation=case["dilation"], groups=case["groups"],
                bias=case["bias"], padding_mode=case["padding_mode"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["m"], case["c_in"], *case["spatial"], generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*padding='same'.*")
        check_layer(layer, x, case["reduction"], case["seed"], case["x_grad"], case["in_backward"])
