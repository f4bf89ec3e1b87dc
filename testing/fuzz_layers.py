"""Random single-layer configurations and the check of every curvature op on one.

A case is one covered layer (Linear on ``[m, *seq, d]``, Conv1d/2d/3d with random groups,
stride, dilation, padding and padding mode, ConvTranspose1d/2d/3d with random groups,
stride, dilation, padding and output padding; bias or not), called once or twice per forward
(two calls are extra positions of one layer), on the input or on its ReLU, in float32 or
float64, with either capture path (``I``/``G`` kept, or per-sample gradients ``P`` made in
the backward).

The loss is a fixed nonlinear readout outside the layer, ``ℓ_i = Σ tanh(out_i) ⊙ R_i``
with a fixed random ``R``, so ``G`` is non-trivial and only the layer under test is
covered. The oracle ``J`` comes from ``torch.func`` (``vmap(grad)``) on a float64 copy of
the unprepared model; float64 cases must agree to ``1e-9``, float32 ones to ``1e-4``
(relative, in norm).

With ``compiled``, the prepared model's forward and backward run through
``torch.compile``; the same checks hold, and its records must equal those of an eager
run of the same model and batch (:data:`~testing.records.RECORD_TOL`).
"""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import torch
import torch.nn as nn
from hypothesis import HealthCheck
from hypothesis import strategies as st

import tengrad_fx

from .oracle import explicit_jacobian, per_sample_grads_reference
from .records import RECORD_TOL, assert_same, compile_model, snapshot

__all__ = ["SETTINGS", "TOL", "KINDS", "layer_cases", "build_layer_case", "check_layer", "One", "Twice"]

TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
SETTINGS: dict[str, Any] = dict(
    deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


class One(nn.Module):
    """The layer called once, on ``x`` or (``relu_in``) on ``relu(x)``."""

    def __init__(self, layer: nn.Module, relu_in: bool = False):
        super().__init__()
        self.layer = layer
        self.relu_in = relu_in

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(torch.relu(x) if self.relu_in else x)


class Twice(One):
    """The layer called on ``h`` and on ``tanh(h)`` (``h``: ``x`` or ``relu(x)``): one layer,
    two calls (its positions add); output ``[m, n₁ + n₂]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x) if self.relu_in else x
        return torch.cat([self.layer(h).flatten(1), self.layer(torch.tanh(h)).flatten(1)], 1)


def _readout(out: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
    """Σ tanh(out) ⊙ R (one sample's loss when called on one sample)."""
    return (torch.tanh(out) * R).sum()


@st.composite
def _conv(draw: Any, nd: int) -> dict[str, Any]:
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 4 if nd < 3 else 2)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 3 if nd < 3 else 2)) for _ in range(nd))
    pad_kind = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    if pad_kind == "same":  # PyTorch allows 'same' only with stride 1
        stride: tuple[int, ...] = (1,) * nd
    else:
        stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    padding: Any
    if pad_kind == "int":
        padding = draw(st.integers(0, 3 if nd < 3 else 1))
        pads = (padding,) * nd
    elif pad_kind == "tuple":
        padding = tuple(draw(st.integers(0, 3 if nd < 3 else 1)) for _ in range(nd))
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
    extra = {1: 8, 2: 5, 3: 2}[nd]
    for k, dl, p in zip(kernel, dilation, pads):
        lo = max(1, dl * (k - 1) + 1 - 2 * p, p + 1)  # >= one output; reflect needs p < n
        spatial.append(draw(st.integers(lo, lo + extra)))
    return dict(
        kind=f"conv{nd}d", c_in=groups * draw(st.integers(1, 3)), c_out=groups * draw(st.integers(1, 3)),
        kernel=kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
        padding_mode=padding_mode, positions=tuple(spatial),
    )


@st.composite
def _conv_transpose(draw: Any, nd: int) -> dict[str, Any]:
    groups = draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    dilation = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(nd))
    # torch: output_padding < max(stride, dilation)
    output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    spatial = []
    for k, s, d, p, op in zip(kernel, stride, dilation, padding, output_padding):
        # output size (n-1)·s - 2p + d(k-1) + op + 1 >= 1
        lo = max(1, 1 + -(-(2 * p - d * (k - 1) - op) // s))
        spatial.append(draw(st.integers(lo, lo + (2 if nd == 3 else 4))))
    return dict(
        kind=f"convT{nd}d", c_in=groups * draw(st.integers(1, 3)), c_out=groups * draw(st.integers(1, 3)),
        kernel=kernel, stride=stride, padding=padding, output_padding=output_padding,
        dilation=dilation, groups=groups, positions=tuple(spatial),
    )


@st.composite
def _linear(draw: Any) -> dict[str, Any]:
    return dict(kind="linear", d_in=draw(st.integers(1, 9)), d_out=draw(st.integers(1, 9)),
                positions=tuple(draw(st.lists(st.integers(1, 4), max_size=2))))


KINDS = ("linear", "conv1d", "conv2d", "conv2d", "conv3d", "convT1d", "convT2d", "convT3d")


@st.composite
def layer_cases(draw: Any, kinds: tuple[str, ...] = KINDS) -> dict[str, Any]:
    """One random layer configuration (a dict; see the module docstring) of one of ``kinds``
    (``"linear"``, ``"conv{1,2,3}d"``, ``"convT{1,2,3}d"``: transposed)."""
    kind = draw(st.sampled_from(kinds))
    if kind == "linear":
        case = draw(_linear())
    elif kind.startswith("convT"):
        case = draw(_conv_transpose(int(kind[5])))
    else:
        case = draw(_conv(int(kind[4])))
    case.update(
        bias=draw(st.booleans()), m=draw(st.integers(1, 6)), calls=draw(st.sampled_from([1, 1, 2])),
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        reduction=draw(st.sampled_from(["sum", "mean"])), seed=draw(st.integers(0, 2**16)),
        x_grad=draw(st.booleans()), in_backward=draw(st.booleans()), relu_in=draw(st.booleans()),
    )
    return case


def build_layer_case(case: dict[str, Any]) -> tuple[nn.Module, torch.Tensor]:
    """``(model, x)``: the layer wrapped in :class:`One` / :class:`Twice`, and a batch."""
    torch.manual_seed(case["seed"])
    if case["kind"] == "linear":
        layer: nn.Module = nn.Linear(case["d_in"], case["d_out"], bias=case["bias"])
        shape = (*case["positions"], case["d_in"])
    elif case["kind"].startswith("convT"):
        cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[int(case["kind"][5])]
        layer = cls(case["c_in"], case["c_out"], case["kernel"], stride=case["stride"],
                    padding=case["padding"], output_padding=case["output_padding"], groups=case["groups"],
                    bias=case["bias"], dilation=case["dilation"])
        shape = (case["c_in"], *case["positions"])
    else:
        cls = {"conv1d": nn.Conv1d, "conv2d": nn.Conv2d, "conv3d": nn.Conv3d}[case["kind"]]
        layer = cls(case["c_in"], case["c_out"], case["kernel"], stride=case["stride"],
                    padding=case["padding"], dilation=case["dilation"], groups=case["groups"],
                    bias=case["bias"], padding_mode=case["padding_mode"])
        shape = (case["c_in"], *case["positions"])
    model = (One if case["calls"] == 1 else Twice)(layer, case["relu_in"]).to(case["dtype"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    x = torch.randn(case["m"], *shape, generator=g, dtype=torch.float64).to(case["dtype"])
    return model, x


def _close(a: torch.Tensor, b: torch.Tensor, scale: float, tol: float) -> bool:
    return bool((a.double() - b.double()).norm() <= tol * scale)


def check_layer(model: nn.Module, x: torch.Tensor, reduction: str, seed: int, x_grad: bool = False,
                in_backward: bool = False, compiled: bool = False, backend: str = "inductor") -> None:
    """Prepare ``model`` (whose only covered layer is ``model.layer``; ``x``: ``[m, ...]``),
    capture one batch, and check ``per_sample_grads``, ``gram`` (every strategy), ``jvp``
    and ``vjp`` against ``J`` (``[m, n]``) from ``torch.func`` in float64.

    ``x_grad``: the input requires grad (the backward op then also computes the input grad).
    ``in_backward``: the layer's sites are in ``store.jacobian_sites``, so the backward op
    keeps the per-sample gradients ``P`` instead of ``I``/``G``.
    ``compiled``: capture through ``torch.compile(prepared, backend=backend)``, and check
    the records against an eager capture of a copy of ``model`` on the same batch.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*padding='same'.*")
        _check_layer(model, x, reduction, seed, x_grad, in_backward, compiled, backend)


def _capture(model: nn.Module, x: torch.Tensor, R: torch.Tensor, reduction: str, x_grad: bool,
             in_backward: bool, backend: Optional[str]) -> nn.Module:
    """The prepared ``model`` after one backward of the readout loss on ``x`` (through
    ``torch.compile`` with ``backend``, unless None)."""
    prepared = tengrad_fx.prepare(model, example_inputs=(x[:2],), loss_reduction=reduction)
    if in_backward:
        info = tengrad_fx.get_info(prepared)
        info.store.jacobian_sites = set(info.layers[0].sites)
    fwd = prepared if backend is None else compile_model(prepared, backend)
    loss = _readout(fwd(x.detach().requires_grad_(x_grad)), R.to(x.dtype))
    (loss / x.shape[0] if reduction == "mean" else loss).backward()
    return prepared


def _check_layer(model: nn.Module, x: torch.Tensor, reduction: str, seed: int, x_grad: bool,
                 in_backward: bool, compiled: bool, backend: str) -> None:
    layer = model.layer
    dtype = x.dtype
    tol = TOL[dtype]
    m = x.shape[0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out_shape = model(x).shape
    R = torch.randn(out_shape, generator=g, dtype=torch.float64)

    ref_model = copy.deepcopy(model).double()
    ref = per_sample_grads_reference(ref_model, x.double(), _readout, R)
    J = explicit_jacobian(ref, "layer.weight", "layer.bias" if layer.bias is not None else None)
    K = J @ J.T
    nJ = J.norm().item()

    eager = None
    if compiled:
        eager = snapshot(_capture(copy.deepcopy(model), x, R, reduction, x_grad, in_backward, None))
    prepared = _capture(model, x, R, reduction, x_grad, in_backward, backend if compiled else None)
    if eager is not None:
        assert_same(snapshot(prepared), eager, RECORD_TOL[dtype])
    layers = tengrad_fx.covered_layers(prepared)
    assert len(layers) == 1
    cl = layers[0]
    assert cl.m == m and cl.materialized == in_backward
    assert len(cl.records()) == len(cl.spec.sites) == (2 if isinstance(model, Twice) else 1)

    dW, db = cl.per_sample_grads()
    assert dW.shape == (m, *layer.weight.shape) and dW.dtype == dtype
    assert _close(dW, ref["layer.weight"], ref["layer.weight"].norm().item(), tol)
    if layer.bias is None:
        assert db is None
    else:
        assert db is not None and _close(db, ref["layer.bias"], ref["layer.bias"].norm().item(), tol)

    for how in ("factor", "materialize", "auto"):
        Kh = cl.gram(how)
        assert Kh.shape == (m, m) and Kh.dtype == dtype
        assert _close(Kh, K, K.norm().item(), tol), (how, ((Kh.double() - K).norm() / K.norm()).item())

    vw = torch.randn(layer.weight.shape, generator=g, dtype=torch.float64)
    vb = None if layer.bias is None else torch.randn(layer.bias.shape, generator=g, dtype=torch.float64)
    v = vw.flatten() if vb is None else torch.cat([vw.flatten(), vb])
    Jv = cl.jvp(vw.to(dtype), None if vb is None else vb.to(dtype))
    assert Jv.shape == (m,)
    assert _close(Jv, J @ v, nJ * v.norm().item(), tol)

    c = torch.randn(m, generator=g, dtype=torch.float64)
    gw, gb = cl.vjp(c.to(dtype))
    Jc = J.T @ c
    n_w = layer.weight.numel()
    assert gw.shape == layer.weight.shape
    assert _close(gw.flatten(), Jc[:n_w], nJ * c.norm().item(), tol)
    if layer.bias is None:
        assert gb is None
    else:
        assert gb is not None and gb.shape == layer.bias.shape
        assert _close(gb, Jc[n_w:], nJ * c.norm().item(), tol)
