"""``nn.Embedding`` (also ``padding_idx``, several calls): per-sample gradients, the
index-matching Gram, ``J v`` and ``Jᵀ c`` against ``torch.func`` on the ORIGINAL model, and
the TENGraD update against the dense float64 solve."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tengrad_fx
from tengrad_fx import TENGraD
from testing import check_tengrad_step, per_sample_grads_reference

TOL = 1e-10


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


class Bag(nn.Module):
    """Embedding of ``[m, *positions]`` token ids (optionally a second lookup of shifted
    ids through the same table), tanh, mean over positions, Linear head."""

    def __init__(self, vocab: int, d: int, padding_idx: int | None, twice: bool):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.head = nn.Linear(d, 3)
        self.twice = twice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(idx))
        if self.twice:
            h = h + self.emb((idx + 1) % self.emb.num_embeddings)
        return self.head(h.flatten(1, -2).mean(1))


def _setup(vocab, d, pos, pad, twice, m, seed):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = Bag(vocab, d, pad, twice).double()
    orig = copy.deepcopy(net)
    idx = torch.randint(0, vocab, (m, *pos), generator=gen)
    y = torch.randint(0, 3, (m,), generator=gen)
    prepared = tengrad_fx.prepare(net, example_inputs=(idx[:2],))
    return orig, prepared, idx, y


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 9), d=st.integers(1, 4), pos=st.sampled_from([(1,), (5,), (2, 3)]),
       pad=st.one_of(st.none(), st.integers(0, 1)), twice=st.booleans(), m=st.integers(2, 5),
       seed=st.integers(0, 2**16))
def test_embedding_exact(vocab, d, pos, pad, twice, m, seed) -> None:  # type: ignore[no-untyped-def]
    orig, prepared, idx, y = _setup(vocab, d, pos, pad, twice, m, seed)
    F.cross_entropy(prepared(idx), y).backward()
    layer = next(la for la in tengrad_fx.covered_layers(prepared) if la.kind == "embedding")
    assert len(layer.spec.sites) == (2 if twice else 1)
    assert "auto->index matching" in str(tengrad_fx.report(prepared))
    ref = per_sample_grads_reference(orig, idx, F.cross_entropy, y)["emb.weight"]
    dW, db = layer.per_sample_grads()
    assert db is None
    assert rel(dW, ref) <= TOL
    if pad is not None:
        assert dW[:, pad].abs().max() == 0
    J = ref.flatten(1)
    assert layer.choose("auto") == "factor" and layer.choose("materialize") == "factor"
    assert rel(layer.gram(), J @ J.T) <= TOL
    gen = torch.Generator().manual_seed(seed + 1)
    v = torch.randn(layer.weight.shape, generator=gen, dtype=torch.float64)
    assert rel(layer.jvp(v), J @ v.flatten()) <= TOL
    c = torch.randn(m, generator=gen, dtype=torch.float64)
    gw, gb = layer.vjp(c)
    assert gb is None and rel(gw.flatten(), J.T @ c) <= TOL


def test_tengrad_update_with_embedding_is_exact() -> None:
    orig, model, idx, y = _setup(7, 3, (4,), 0, True, 6, 5)
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    assert not tengrad_fx.get_info(model).store.jacobian_sites & set(
        next(s for s in tengrad_fx.get_info(model).layers if s.kind == "embedding").sites)
    check_tengrad_step(model, opt, orig, idx, y, 0.05)


def test_embedding_fallback_reasons() -> None:
    net = nn.ModuleDict({"a": nn.Embedding(5, 2, max_norm=1.0), "b": nn.Embedding(5, 2, scale_grad_by_freq=True),
                         "c": nn.Embedding(5, 2, sparse=True), "head": nn.Linear(6, 2)})

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, i: torch.Tensor) -> torch.Tensor:
            n = self.net
            return n["head"](torch.cat([n["a"](i), n["b"](i), n["c"](i)], -1))

    prepared = tengrad_fx.prepare(M(), example_inputs=(torch.randint(0, 5, (2,)),))
    fb = tengrad_fx.get_info(prepared).fallback
    assert "max_norm" in fb["net.a.weight"] and "scale_grad_by_freq" in fb["net.b.weight"]
    assert "sparse" in fb["net.c.weight"]
    assert "net.head.weight" in tengrad_fx.get_info(prepared).covered


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 6), S=st.integers(1, 4), vocab=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_both_gram_routes_equal_the_dense_gram(m: int, S: int, vocab: int, seed: int) -> None:
    """The position-pair route and the ``Z`` route each give ``Z Zᵀ`` of the dense per-sample
    gradients, whichever the kernel would pick for these sizes."""
    from tengrad_fx.curvature import embedding
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab, (m, S), generator=gen)
    g = torch.randn(m, S, 3, generator=gen, dtype=torch.float64)
    Z = embedding._scatter(idx, g, idx, vocab).reshape(m, -1)
    uniq, inv = torch.unique(idx, return_inverse=True)
    Zu = embedding._scatter(idx, g, inv.reshape(m, S), uniq.numel()).reshape(m, -1)
    assert rel(embedding._pair_gram(idx, g), Z @ Z.T) <= TOL
    assert rel(Zu @ Zu.T, Z @ Z.T) <= TOL
