"""The capture ops under ``torch.autocast``: the same output dtype, values and gradient
dtypes as the plain modules (the casts of :mod:`tengrad_fx.capture.amp`), records in the
dtype autograd delivers them, materialized per-sample gradients in float32."""
from __future__ import annotations

import copy

import pytest
import timm.layers as tl
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx import get_info

from testing.all_kinds import AllKinds, inputs


class _Tok(nn.Module):
    """A position token added to a bf16 activation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.pos = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.pos


class _Emb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6, padding_idx=1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx)


class _Attn(nn.Module):
    """A Linear, then ``nn.MultiheadAttention``: packed self-attention, or separate q/k/v
    weights (cross-attention with ``kdim = vdim = 4``; ``in_proj_bias`` an added parameter)."""

    def __init__(self, packed: bool) -> None:
        super().__init__()
        self.packed = packed
        self.inp = nn.Linear(6, 8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True, kdim=None if packed else 4,
                                         vdim=None if packed else 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        kv = h if self.packed else h[..., :4]
        return self.att(h, kv, kv, need_weights=False)[0]


def _single(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """One layer of ``kind`` and an fp32 input batch of 4."""
    g = torch.Generator().manual_seed(1)
    img = torch.randn(4, 4, 5, 5, generator=g)
    tok = torch.randn(4, 4, 6, generator=g)
    table = {
        "linear": (nn.Linear(6, 3), tok),
        "conv2d": (nn.Conv2d(4, 3, 3, padding=1), img),
        "conv2d_reflect": (nn.Conv2d(4, 3, 3, padding=1, padding_mode="reflect"), img),
        "conv_groups": (nn.Conv2d(4, 4, 3, groups=2), img),
        "conv_transpose2d": (nn.ConvTranspose2d(4, 3, 2, stride=2), img),
        "conv1d": (nn.Conv1d(4, 3, 3), img.flatten(2)),
        "batchnorm": (nn.BatchNorm2d(4), img),
        "layernorm": (nn.LayerNorm(6), tok),
        "groupnorm": (nn.GroupNorm(2, 4), img),
        "rmsnorm": (nn.RMSNorm(6), tok),
        "timm_rmsnorm": (tl.RmsNorm(6), tok),
        "timm_layernorm2d": (tl.LayerNorm2d(4), img),
        "timm_rmsnorm2d": (tl.RmsNorm2d(4), img),
        "token": (_Tok(), tok),
        "embedding": (_Emb(), torch.randint(0, 9, (4, 5), generator=g)),
        "mha_packed": (_Attn(True), tok),
        "mha_separate": (_Attn(False), tok),
    }
    mod, x = table[kind]
    return nn.Sequential(mod), x


KINDS = ["linear", "conv2d", "conv2d_reflect", "conv_groups", "conv_transpose2d", "conv1d", "batchnorm",
         "layernorm", "groupnorm", "rmsnorm", "timm_rmsnorm", "timm_layernorm2d", "timm_rmsnorm2d", "token",
         "embedding", "mha_packed", "mha_separate"]


def _run(mod: nn.Module, x: torch.Tensor,
         low: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """Output, parameter gradients and input gradient of ``sum(out²)`` (backward outside
    autocast, as a training loop does), the input given in bf16 when ``low``."""
    for p in mod.parameters():
        p.grad = None
    if x.is_floating_point():
        x = (x.bfloat16() if low else x).detach().requires_grad_()
    with torch.autocast("cpu", torch.bfloat16):
        out = mod(x)
    out.float().pow(2).sum().backward()
    return out, {n: p.grad for n, p in mod.named_parameters()}, x.grad if x.is_floating_point() else None


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("low_input", [False, True])
@pytest.mark.parametrize("materialize", [False, True])
def test_capture_ops_mirror_autocast(kind: str, low_input: bool, materialize: bool) -> None:
    """Same output dtype and values as the plain module under CPU bf16 autocast (fp32 or
    bf16 input), fp32 parameter gradients equal to the plain module's up to fp32 rounding
    (the per-sample sums of the norm and token ops accumulate in fp32) or, for
    materialized layers (weight gradient = Σ_i of fp32 per-sample gradients, one bf16
    rounding), up to bf16 rounding; the input gradient in the input's dtype."""
    torch.manual_seed(0)
    plain, x = _single(kind)
    pm = tengrad_fx.prepare(copy.deepcopy(plain), example_inputs=(x,))
    store = get_info(pm).store
    assert tengrad_fx.report(pm).n_fallback == 0, tengrad_fx.report(pm)
    if materialize:
        store.jacobian_sites = set(range(store.n_sites))
    out_ref, g_ref, gx_ref = _run(plain, x, low_input)
    out, g, gx = _run(pm, x, low_input)
    assert out.dtype == out_ref.dtype
    assert torch.equal(out, out_ref)
    # aten's norm backward sums dγ of a bf16 input in bf16; the capture ops in fp32
    exact = not materialize and kind.startswith(("linear", "conv"))
    tol = 0.0 if exact else 1e-2 if materialize or low_input or kind.startswith("mha") else 1e-6
    scale = max(ref.norm() for ref in g_ref.values())  # a bias gradient can be ~0 (sum over a BN)
    for n, ref in g_ref.items():
        assert g[n].dtype == ref.dtype == torch.float32, n
        assert (g[n] - ref).norm() <= tol * scale, (n, ((g[n] - ref).norm() / scale).item())
    if gx_ref is not None:
        assert gx is not None and gx.dtype == gx_ref.dtype
        torch.testing.assert_close(gx, gx_ref, rtol=2e-2, atol=1e-3)
    recs = [r for rs in store.records.values() for r in rs]
    assert recs
    for r in recs:
        for t in (r.P, r.Gsum):
            assert t is None or t.dtype == torch.float32  # per-sample sums: fp32


def test_linear_conv_records_are_low_precision() -> None:
    """Linear/conv records ``I``, ``G`` stay in the autocast dtype (half the memory) until
    the optimizer converts them at the step."""
    model = tengrad_fx.prepare(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(64, 5)),
                               example_inputs=(torch.randn(2, 3, 6, 6),))
    with torch.autocast("cpu", torch.bfloat16):
        out = model(torch.randn(4, 3, 6, 6))
    out.float().sum().backward()
    recs = [r for rs in get_info(model).store.records.values() for r in rs]
    assert len(recs) == 2
    for r in recs:
        assert r.I.dtype == r.G.dtype == torch.bfloat16


def test_all_kinds_model_matches_plain() -> None:
    """A model with every capture kind: bit-identical bf16 output, fp32 gradients within
    fp32 rounding of the plain model's."""
    torch.manual_seed(0)
    net = AllKinds()
    x, idx = inputs(6)
    pm = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=(x, idx))
    outs = []
    for mod in (net, pm):
        with torch.autocast("cpu", torch.bfloat16):
            out = mod(x, idx)
        out.float().pow(2).sum().backward()
        outs.append(out)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    pp = dict(pm.named_parameters())
    for n, p in net.named_parameters():
        assert ((p.grad - pp[n].grad).norm() / p.grad.norm()).item() <= 1e-6, n
