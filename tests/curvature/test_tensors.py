"""Unit tests of ``tengrad_fx.curvature.tensors``, the conv layout, the cost model and
the errors of ``CoveredLayer``."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.capture.match import LayerSpec, conv_call_args
from tengrad_fx.curvature import choose_strategy, conv, gram_flops, tensors
from tengrad_fx.curvature import linear as linear_kernel

D = torch.float64


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def make_AB(m: int, g: int, S: int, f: int, o: int, seed: int = 0, dtype=D):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    A = torch.randn(m, g, S, f, generator=gen, dtype=dtype)
    B = torch.randn(m, g, S, o, generator=gen, dtype=dtype)
    return A, B


def explicit_J(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(J_w [m, g·o·f], J_b [m, g·o])`` by a plain einsum."""
    m = A.shape[0]
    dW = torch.einsum("mgso,mgsf->mgof", B, A)
    return dW.reshape(m, -1), B.sum(2).reshape(m, -1)


SHAPES = [  # (m, g, S, f, o)
    (5, 1, 1, 7, 3), (6, 3, 1, 4, 2), (7, 1, 9, 5, 4), (4, 2, 6, 3, 5), (1, 1, 4, 2, 2), (9, 4, 3, 1, 1),
]


# --------------------------------------------------------------------------- pure math
@pytest.mark.parametrize("shape", SHAPES)
def test_per_sample_grads_and_bias_gram(shape: tuple[int, ...]) -> None:
    A, B = make_AB(*shape)
    Jw, Jb = explicit_J(A, B)
    dW, db = tensors.per_sample_grads(A, B)
    m, g, S, f, o = shape
    assert dW.shape == (m, g, o, f) and db.shape == (m, g, o)
    assert rel(dW.reshape(m, -1), Jw) <= 1e-13
    assert rel(db.reshape(m, -1), Jb) <= 1e-13
    assert rel(tensors.gram_bias(B), Jb @ Jb.T) <= 1e-13


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_factor_and_materialize_exact(shape: tuple[int, ...]) -> None:
    A, B = make_AB(*shape)
    Jw, _ = explicit_J(A, B)
    K = Jw @ Jw.T
    assert rel(tensors.gram_factor(A, B), K) <= 1e-12
    assert rel(tensors.gram_materialize(A, B), K) <= 1e-12


@pytest.mark.parametrize("m", [1, 2, 7, 10])
def test_gram_factor_blocking(m: int) -> None:
    """Tiny ``block_bytes`` → one sample per block (m² blocks); other sizes → ragged
    blocks; all equal one single block and the explicit Gram."""
    g, S, f, o = 2, 5, 3, 4
    A, B = make_AB(m, g, S, f, o, seed=m)
    one = tensors.gram_factor(A, B, block_bytes=2**40)
    per_pair = 2 * g * S * S * A.element_size()
    for blk in (1, 2, 3, m):
        K = tensors.gram_factor(A, B, block_bytes=per_pair * blk * blk)
        assert rel(K, one) <= 1e-13, blk
    tiny = tensors.gram_factor(A, B, block_bytes=1)
    assert rel(tiny, one) <= 1e-13
    assert torch.equal(tiny, tiny.T)  # the mirrored off-diagonal blocks are exact copies
    Jw, _ = explicit_J(A, B)
    assert rel(one, Jw @ Jw.T) <= 1e-12


@pytest.mark.parametrize("m,g,S,f,o", [(6, 1, 4, 5, 7), (5, 3, 2, 2, 5), (3, 2, 1, 4, 3)])
def test_gram_materialize_chunking(m: int, g: int, S: int, f: int, o: int) -> None:
    """``block_bytes`` below one channel's per-sample grads → one output channel per chunk."""
    A, B = make_AB(m, g, S, f, o, seed=o)
    one = tensors.gram_materialize(A, B, block_bytes=2**40)
    per_channel = m * g * f * A.element_size()
    for bb in (1, per_channel, 2 * per_channel, 3 * per_channel + 1):  # chunks 1, 1, 2, 3 (ragged)
        assert rel(tensors.gram_materialize(A, B, block_bytes=bb), one) <= 1e-13, bb
    Jw, _ = explicit_J(A, B)
    assert rel(one, Jw @ Jw.T) <= 1e-12


@pytest.mark.parametrize("g", [1, 3])
def test_gram_factor_S1_path_equals_general_path(g: int) -> None:
    """The ``S == 1`` shortcut equals the blocked ``S > 1`` code on the same data padded with
    a zero position (which adds nothing to any gradient)."""
    A, B = make_AB(6, g, 1, 5, 4, seed=g)
    A2 = torch.cat([A, torch.zeros_like(A)], 2)
    B2 = torch.cat([B, torch.randn_like(B)], 2)  # G at the zero input position still counts for the bias only
    K1 = tensors.gram_factor(A, B)
    K2 = tensors.gram_factor(A2, B2)
    K3 = tensors.gram_factor(A2, B2, block_bytes=1)
    assert rel(K1, K2) <= 1e-13 and rel(K1, K3) <= 1e-13
    Jw, _ = explicit_J(A, B)
    assert rel(K1, Jw @ Jw.T) <= 1e-13


@pytest.mark.parametrize("shape", SHAPES)
def test_jvp_vjp(shape: tuple[int, ...]) -> None:
    m, g, S, f, o = shape
    A, B = make_AB(*shape)
    Jw, Jb = explicit_J(A, B)
    gen = torch.Generator().manual_seed(3)
    vW = torch.randn(g, o, f, generator=gen, dtype=D)
    vb = torch.randn(g, o, generator=gen, dtype=D)
    assert rel(tensors.jvp(A, B, vW), Jw @ vW.flatten()) <= 1e-12
    assert rel(tensors.jvp(A, B, vW, vb), Jw @ vW.flatten() + Jb @ vb.flatten()) <= 1e-12
    c = torch.randn(m, generator=gen, dtype=D)
    gW, gb = tensors.vjp(A, B, c)
    assert gW.shape == (g, o, f) and gb.shape == (g, o)
    assert rel(gW.flatten(), Jw.T @ c) <= 1e-12
    assert rel(gb.flatten(), Jb.T @ c) <= 1e-12


def test_float32_stays_float32() -> None:
    A, B = make_AB(4, 2, 3, 3, 2, dtype=torch.float32)
    for K in (tensors.gram_factor(A, B), tensors.gram_materialize(A, B), tensors.gram_bias(B)):
        assert K.dtype == torch.float32
    A64, B64 = A.double(), B.double()
    Jw, _ = explicit_J(A64, B64)
    assert rel(tensors.gram_factor(A, B).double(), Jw @ Jw.T) <= 1e-5
    assert rel(tensors.gram_materialize(A, B).double(), Jw @ Jw.T) <= 1e-5


# --------------------------------------------------------------------------- conv layout
CONV_CASES = [  # (nd, c_in, c_out, k, stride, padding, dilation, groups, spatial)
    (2, 4, 6, 3, 1, 1, 1, 1, (6, 5)),
    (2, 4, 6, (3, 2), (2, 1), (2, 0), (1, 2), 2, (9, 7)),
    (2, 3, 6, 3, 2, 1, 2, 3, (8, 8)),
    (1, 2, 4, 4, 3, 2, 2, 2, (13,)),
    (3, 2, 2, (2, 1, 3), (1, 2, 1), (1, 0, 1), (2, 1, 1), 1, (4, 3, 5)),
]


def _conv_spec(nd: int, c_in: int, c_out: int, k, stride, padding, dilation, groups: int):  # type: ignore[no-untyped-def]
    mod = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd](
        c_in, c_out, k, stride=stride, padding=padding, dilation=dilation, groups=groups).double()
    args = conv_call_args(mod)
    spec = LayerSpec(name="conv", kind=f"conv{nd}d", module=mod, stride=args["stride"],  # type: ignore[arg-type]
                     padding=args["padding"], dilation=args["dilation"], groups=args["groups"])
    return mod, spec


@pytest.mark.parametrize("case", CONV_CASES)
def test_conv_layout_dims_and_grads(case: tuple) -> None:  # type: ignore[type-arg]
    """``conv.layout``'s (A, B) give aten's weight/bias gradient per sample; ``conv.dims``
    matches the shapes; 2-D patches equal ``F.unfold``'s."""
    nd, c_in, c_out, k, stride, padding, dilation, groups, spatial = case
    mod, spec = _conv_spec(nd, c_in, c_out, k, stride, padding, dilation, groups)
    m = 3
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, c_in, *spatial, generator=gen, dtype=D)
    y = mod(x)
    G = torch.randn(y.shape, generator=gen, dtype=D)
    A, B = conv.layout(spec, x, G)
    g, S, f, o = conv.dims(spec, tuple(x.shape))
    assert (g, S, f, o) == (groups, math.prod(y.shape[2:]), mod.weight[0].numel(), c_out // groups)
    assert A.shape == (m, g, S, f) and B.shape == (m, g, S, o)
    dW, db = tensors.per_sample_grads(A, B)
    for i in range(m):
        gw, gb = torch.autograd.grad(mod(x[i:i + 1]), (mod.weight, mod.bias), G[i:i + 1])
        assert rel(dW[i].reshape(gw.shape), gw) <= 1e-12
        assert rel(db[i].reshape(gb.shape), gb) <= 1e-12
    if nd == 2:
        ks = mod.kernel_size
        cols = F.unfold(x, ks, dilation=mod.dilation, padding=mod.padding, stride=mod.stride)  # [m, c·Πk, S]
        ref = cols.transpose(1, 2).reshape(m, S, g, f).transpose(1, 2)
        assert torch.equal(A, ref)
    # jvp / vjp of the kernel (one conv / one weight-grad conv) against the layout's J
    Jw, Jb = explicit_J(A, B)
    vW = torch.randn(mod.weight.shape, generator=gen, dtype=D)
    vb = torch.randn(c_out, generator=gen, dtype=D)
    assert rel(conv.jvp(spec, x, G, vW, vb), Jw @ vW.flatten() + Jb @ vb) <= 1e-12
    c = torch.randn(m, generator=gen, dtype=D)
    gW, gB = conv.vjp(spec, x, G, c)
    assert rel(gW.flatten(), Jw.T @ c) <= 1e-12 and rel(gB, Jb.T @ c) <= 1e-12


def test_linear_layout_dims() -> None:
    mod = nn.Linear(5, 3).double()
    spec = LayerSpec(name="fc", kind="linear", module=mod)
    x = torch.randn(4, 2, 3, 5, dtype=D)
    G = torch.randn(4, 2, 3, 3, dtype=D)
    A, B = linear_kernel.layout(spec, x, G)
    assert A.shape == (4, 1, 6, 5) and B.shape == (4, 1, 6, 3)
    assert linear_kernel.dims(spec, tuple(x.shape)) == (1, 6, 5, 3)
    assert linear_kernel.dims(spec, (4, 5)) == (1, 1, 5, 3)


# --------------------------------------------------------------------------- cost model
def test_gram_flops_formulas() -> None:
    m, g, S, f, o = 8, 2, 5, 3, 4
    c = gram_flops(m, g, S, f, o)
    assert c["factor"] == 2 * m * m * S * S * (f + o) * g
    assert c["materialize"] == 2 * m * S * f * o * g + 2 * m * m * f * o * g


def test_cost_model_3c1f_examples() -> None:
    """The 3C1F numbers at m=128 in docs/design.md (Gram cost model)."""
    conv_c = gram_flops(128, 1, 784, 1152, 128)  # conv 128→128 at 28×28, 3×3
    assert conv_c["factor"] == pytest.approx(2.58e13, rel=0.01)
    assert conv_c["materialize"] == pytest.approx(3.44e10, rel=0.01)
    assert choose_strategy(128, 1, 784, 1152, 128) == "materialize"
    fc = gram_flops(128, 1, 1, 10368, 500)  # Linear 10368→500
    assert fc["factor"] == pytest.approx(3.56e8, rel=0.01)
    assert fc["materialize"] == pytest.approx(1.71e11, rel=0.01)
    assert choose_strategy(128, 1, 1, 10368, 500) == "factor"
    # first conv 1→128 (f = 9): still materialize; last Linear 500→10: factor
    assert choose_strategy(128, 1, 784, 9, 128) == "materialize"
    assert choose_strategy(128, 1, 1, 500, 10) == "factor"


def test_choose_strategy_tie_and_monotone() -> None:
    # a tie resolves to factor
    assert gram_flops(1, 1, 1, 1, 1) == {"factor": 4.0, "materialize": 4.0}
    assert choose_strategy(1, 1, 1, 1, 1) == "factor"
    # growing S flips factor → materialize for a fixed layer
    picks = [choose_strategy(32, 1, S, 64, 64) for S in (1, 4, 16, 64, 256)]
    assert picks[0] == "factor" and picks[-1] == "materialize"
    assert picks == sorted(picks)  # "factor" < "materialize": one flip only


# --------------------------------------------------------------------------- CoveredLayer
def _prepared(bias: bool = True):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=bias), nn.Tanh(), nn.Flatten(),
                          nn.Linear(3 * 4 * 4, 5, bias=bias)).double()
    x = torch.randn(4, 2, 4, 4, dtype=D)
    return tengrad_fx.prepare(model, example_inputs=(x[:2],)), x


def test_layer_dims_and_auto_choice() -> None:
    prepared, x = _prepared()
    prepared(x).sum().backward()
    conv_l, fc_l = tengrad_fx.covered_layers(prepared)
    assert conv_l.dims() == (1, 16, 18, 3) and fc_l.dims() == (1, 1, 48, 5)
    for layer in (conv_l, fc_l):
        assert layer.m == 4
        assert layer.choose() == choose_strategy(4, *layer.dims())
        assert layer.choose("factor") == "factor" and layer.choose("materialize") == "materialize"
        assert torch.equal(layer.gram(), layer.gram(layer.choose()))


def test_gram_before_capture_raises() -> None:
    prepared, x = _prepared()
    for layer in tengrad_fx.covered_layers(prepared):
        for call in (lambda: layer.gram(), lambda: layer.gram("factor"), lambda: layer.gram("materialize"),  # noqa: B023
                     layer.per_sample_grads, lambda: layer.m,  # noqa: B023
                     lambda: layer.vjp(torch.ones(4, dtype=D)),  # noqa: B023
                     lambda: layer.jvp(torch.zeros_like(layer.weight))):  # noqa: B023
            with pytest.raises(RuntimeError, match=f"'{layer.name}'"):
                call()
    with torch.no_grad():  # no capture without grad either
        prepared(x)
    with pytest.raises(RuntimeError, match="nothing captured"):
        tengrad_fx.covered_layers(prepared)[0].gram()


def test_unknown_strategy_raises() -> None:
    prepared, x = _prepared()
    layer = tengrad_fx.covered_layers(prepared)[0]
    with pytest.raises(ValueError, match="strategy"):
        layer.gram("fast")  # type: ignore[arg-type]
    prepared(x).sum().backward()
    for bad in ("fast", "Auto", "", None):
        with pytest.raises(ValueError, match="strategy"):
            layer.gram(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="strategy"):
            layer.choose(bad)  # type: ignore[arg-type]


def test_wrong_shapes_raise_naming_the_layer() -> None:
    prepared, x = _prepared()
    prepared(x).sum().backward()
    for layer in tengrad_fx.covered_layers(prepared):
        w, b = layer.weight, layer.bias
        for vw, vb in [(torch.zeros(w.numel(), dtype=D), None),              # flattened weight
                       (torch.zeros(*w.shape, 1, dtype=D), None),            # extra dim
                       (torch.zeros_like(w), torch.zeros(b.numel() + 1, dtype=D)),
                       (torch.zeros_like(w), torch.zeros(1, b.numel(), dtype=D))]:
            with pytest.raises(ValueError, match=f"'{layer.name}'"):
                layer.jvp(vw, vb)
        for c in (torch.zeros(3, dtype=D), torch.zeros(4, 1, dtype=D), torch.zeros((), dtype=D)):
            with pytest.raises(ValueError, match=f"'{layer.name}'"):
                layer.vjp(c)


def test_jvp_bias_on_biasless_layer_raises() -> None:
    prepared, x = _prepared(bias=False)
    prepared(x.requires_grad_()).sum().backward()
    for layer in tengrad_fx.covered_layers(prepared):
        assert layer.bias is None
        with pytest.raises(ValueError, match=f"'{layer.name}'.*no bias"):
            layer.jvp(torch.zeros_like(layer.weight), torch.zeros(layer.weight.shape[0], dtype=D))
        assert layer.jvp(torch.zeros_like(layer.weight)).shape == (4,)


class _TwoScales(nn.Module):
    """One conv called at two resolutions: positions 8·8 + 4·4 = 80 per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(x).sum((2, 3)) + self.c(x[:, :, ::2, ::2]).sum((2, 3))


def test_dims_sum_positions_of_all_calls() -> None:
    x = torch.randn(4, 2, 8, 8, dtype=D)
    prepared = tengrad_fx.prepare(_TwoScales().double(), example_inputs=(x[:2],))
    prepared(x).sum().backward()
    assert tengrad_fx.covered_layers(prepared)[0].dims() == (1, 80, 18, 2)


@pytest.mark.parametrize("with_examples", [True, False])
def test_dims_of_materialized_layer(with_examples: bool) -> None:
    x = torch.randn(4, 2, 8, 8, dtype=D)
    prepared = tengrad_fx.prepare(_TwoScales().double(), example_inputs=(x[:2],) if with_examples else None)
    layer = tengrad_fx.covered_layers(prepared)[0]
    tengrad_fx.get_info(prepared).store.jacobian_sites = set(layer.spec.sites)
    prepared(x).sum().backward()
    assert layer.materialized
    assert layer.dims() == (1, 80, 18, 2)
