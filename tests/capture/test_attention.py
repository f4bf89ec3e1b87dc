"""``nn.MultiheadAttention`` and torch's transformer modules: projections preconditioned
exactly. float64 per-sample gradients, Grams, J·v and Jᵀc against ``torch.func``
``vmap(grad)`` on the ORIGINAL model; outputs against the module; the TENGraD step against
the dense float64 block solve."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import tengrad_fx
from tengrad_fx import TENGraD
from testing import check_covered_layers, check_tengrad_step

TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class AttnNet(nn.Module):
    """Linear embedding → MultiheadAttention (self or cross) → mean over positions → head."""

    def __init__(self, E: int, H: int, *, batch_first: bool, kdim: int | None, bias: bool,
                 cross: bool, need_weights: bool, bias_kv: bool = False, zero_attn: bool = False,
                 mask: bool = False):
        super().__init__()
        self.bf, self.cross, self.nw, self.mask = batch_first, cross, need_weights, mask
        self.emb = nn.Linear(3, E)
        self.kemb = nn.Linear(3, kdim or E)
        self.attn = nn.MultiheadAttention(E, H, batch_first=batch_first, kdim=kdim, vdim=kdim, bias=bias,
                                          add_bias_kv=bias_kv, add_zero_attn=zero_attn)
        self.head = nn.Linear(E, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        kv = self.kemb(x[:, :-1]) if self.cross else h  # S = L - 1 for cross attention (L ≥ 3: a key survives the mask)
        kpm = None
        if self.mask:  # the last key of every sample masked out
            kpm = torch.cat([torch.zeros_like(kv[:, 1:, 0], dtype=torch.bool),
                             torch.ones_like(kv[:, :1, 0], dtype=torch.bool)], 1)
        if not self.bf:
            h, kv = h.transpose(0, 1), (h.transpose(0, 1) if kv is h else kv.transpose(0, 1))
        out, w = self.attn(h, kv, kv, key_padding_mask=kpm, need_weights=self.nw)
        if not self.bf:
            out = out.transpose(0, 1)
        z = out.mean(1)
        return self.head(z + w.sum((1, 2))[:, None] if self.nw else z)


def _build(seed: int, **kw):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    net = AttnNet(**kw).double()
    with torch.no_grad():
        for p in net.parameters():  # MHA zero-inits its biases: make every gradient generic
            p.add_(0.3 * torch.randn_like(p))
    return net, copy.deepcopy(net)


@settings(max_examples=25, deadline=None)
@given(H=st.integers(1, 2), hd=st.integers(1, 3), L=st.integers(3, 6), m=st.integers(2, 4),
       batch_first=st.booleans(), packed=st.booleans(), bias=st.booleans(), cross=st.booleans(),
       need_weights=st.booleans(), extra=st.booleans(), mask=st.booleans(), seed=st.integers(0, 2**16))
def test_multihead_attention_projections_exact(H, hd, L, m, batch_first, packed, bias, cross, need_weights,
                                               extra, mask, seed) -> None:  # type: ignore[no-untyped-def]
    E = H * hd
    kdim = None if packed else E + 1
    cross = cross or not packed  # separate q/k/v weights: key/value dims differ from the query's
    net, orig = _build(seed, E=E, H=H, batch_first=batch_first, kdim=kdim, bias=bias, cross=cross,
                       need_weights=need_weights, bias_kv=extra and bias, zero_attn=extra, mask=mask)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, L, 3, dtype=torch.float64, generator=gen)
    y = torch.randint(0, 4, (m,), generator=gen)
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    info = tengrad_fx.get_info(prepared)
    assert info.method == "fx", info.trace_error
    unused = {"kemb.weight", "kemb.bias"} if not cross else set()
    assert set(info.fallback) == unused, info.fallback
    names = {spec.name for spec in info.layers}
    assert "attn.out_proj" in names
    assert ("attn.in_proj" in names) == packed
    assert ({"attn.q_proj_weight", "attn.k_proj_weight", "attn.v_proj_weight"} <= names) == (not packed)
    assert rel(prepared(x), orig(x)) <= 1e-13  # the module's output up to rounding
    check_covered_layers(orig, prepared, x, y)


@pytest.mark.parametrize("packed", [True, False])
def test_tengrad_step_with_attention_is_exact(packed: bool) -> None:
    """Cross attention: packed (one linear on the concatenated inputs) and separate q/k/v."""
    net, orig = _build(3, E=4, H=2, batch_first=False, kdim=None if packed else 3, bias=True, cross=True,
                       need_weights=False, bias_kv=True)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 4, 3, dtype=torch.float64, generator=gen), torch.tensor([0, 1, 2, 3, 1])
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(model, opt, orig, x, y, 0.05)


def _encoder(batch_first: bool, norm_first: bool, decoder: bool) -> nn.Module:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Linear(3, 4)
            layer = nn.TransformerEncoderLayer(4, 2, 6, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
            self.enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(4), enable_nested_tensor=False)
            self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(4, 2, 6, dropout=0.0, batch_first=batch_first),
                                             1) if decoder else None
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.emb(x)
            h = h if batch_first else h.transpose(0, 1)
            L = x.shape[1]
            causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=h.dtype)
            o = self.enc(h, mask=causal)
            if self.dec is not None:
                o = self.dec(h, o, tgt_mask=causal)
            o = o if batch_first else o.transpose(0, 1)
            return self.head(o.mean(1))

    return Net()


@pytest.mark.parametrize("batch_first,norm_first,decoder", [(True, False, False), (False, True, False),
                                                            (True, False, True)])
def test_transformer_layers_fully_covered_and_exact(batch_first: bool, norm_first: bool, decoder: bool) -> None:
    torch.manual_seed(0)
    net = _encoder(batch_first, norm_first, decoder).double()
    orig = copy.deepcopy(net)
    x, y = torch.randn(4, 5, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 1])
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    rep = tengrad_fx.report(prepared)
    assert rep.fraction_params == 1.0, rep.fallbacks
    assert rel(prepared(x), orig(x)) <= 1e-13
    prepared.eval()
    orig.eval()
    with torch.no_grad():  # eval: torch's own encoder forward (fast path included), bit for bit
        assert torch.equal(prepared(x), orig(x))
    prepared.train()
    check_covered_layers(orig, prepared, x, y)


def test_transformer_tengrad_step_is_exact() -> None:
    torch.manual_seed(2)
    net = _encoder(False, False, True).double()
    orig = copy.deepcopy(net)
    x, y = torch.randn(5, 4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(model, opt, orig, x, y, 0.05)


def test_attention_capture_off_is_the_module() -> None:
    net, orig = _build(0, E=4, H=2, batch_first=True, kdim=None, bias=True, cross=False, need_weights=True)
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    with torch.no_grad():
        assert torch.equal(prepared(x), orig(x))
    with tengrad_fx.capturing(prepared, False):
        assert torch.equal(prepared(x), orig(x))


class _MyAttention(nn.MultiheadAttention):
    def forward(self, q, k, v, **kw):  # type: ignore[no-untyped-def, override]
        return super().forward(q, k, v, **kw)


class _Unbatched(nn.Module):
    def __init__(self, cls: type = nn.MultiheadAttention) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.attn = cls(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if isinstance(self.attn, _MyAttention):
            return self.attn(h, h, h)[0]
        return self.attn(h[0], h[0], h[0])[0]  # one unbatched sequence [L, E]


def test_attention_fallback_reasons() -> None:
    x = torch.randn(2, 5, 3)
    fb = tengrad_fx.get_info(tengrad_fx.prepare(_Unbatched(), example_inputs=(x,))).fallback
    assert "does not index samples" in fb["attn.in_proj_weight"]
    assert "does not index samples" in fb["attn.out_proj.weight"]
    fb = tengrad_fx.get_info(tengrad_fx.prepare(_Unbatched(_MyAttention), example_inputs=(x,))).fallback
    assert "_MyAttention" in fb["attn.in_proj_weight"] and "called functionally" in fb["attn.out_proj.weight"]


def test_torchvision_vit_fully_covered_and_exact() -> None:
    """torchvision's ViT encoder blocks call nn.MultiheadAttention(x, x, x, need_weights=False)."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2, hidden_dim=8, mlp_dim=12,
                            num_classes=3).double().eval()
    orig = copy.deepcopy(net)
    x, y = torch.randn(3, 3, 16, 16, dtype=torch.float64), torch.tensor([0, 2, 1])
    prepared = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    assert tengrad_fx.report(prepared).fraction_params == 1.0
    assert sum(s.name.endswith("self_attention.in_proj") for s in tengrad_fx.get_info(prepared).layers) == 2
    prepared.eval()
    check_covered_layers(orig, prepared, x, y, tol=1e-9)
