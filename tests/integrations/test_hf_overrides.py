"""Overriding subclasses that are still provably their base layer, on hand-written models
(float64, module surgery): a Linear subclass whose forward is ``x @ Wᵀ + b``
(:func:`tengrad_fx.capture.match.forward_is_linear`), and Embedding subclasses whose forward
wraps one base lookup — an offset on the indices, a scale on the rows, a scaled lookup
tied to the output layer (:mod:`tengrad_fx.capture.lookups`). Each is covered and its
per-sample gradients, Gram, ``Jv`` and ``Jᵀc`` equal ``torch.func``'s; near misses fall back
with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tengrad_fx import get_info, prepare, report
from tengrad_fx.capture.lookups import overriding_lookup
from tengrad_fx.capture.match import forward_is_linear, match_module
from testing.oracle import check_covered_layers

V, D = 11, 6


class MatmulLinear(nn.Linear):
    def forward(self, input):
        h = input @ self.weight.T
        if self.bias is None:
            return h
        return h + self.bias


class ScaledLinear(nn.Linear):
    def forward(self, input):
        return input @ self.weight.T * 2.0 + self.bias


class OffsetPositions(nn.Embedding):
    """OPT's learned positions: ids from the attention mask, shifted by an offset."""

    def __init__(self, n, d):
        self.offset = 2
        super().__init__(n + self.offset, d)

    def forward(self, attention_mask, past=0, position_ids=None):
        if position_ids is None:
            position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
            position_ids = position_ids[:, past:]
        return super().forward(position_ids + self.offset)


class ScaledTokens(nn.Embedding):
    """Gemma's scaled token embedding (the scale a buffer, cast to the weight's dtype)."""

    def __init__(self, n, d):
        super().__init__(n, d)
        self.register_buffer("scale", torch.tensor(d ** 0.5), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale.to(self.weight.dtype)


class DoubleRead(nn.Embedding):
    """A near miss: the weight also enters the output directly."""

    def forward(self, ids):
        return super().forward(ids) + self.weight.mean()


class TrainOnlyRead(nn.Embedding):
    """A near miss in train mode only (the proof traces both modes)."""

    def forward(self, ids):
        y = super().forward(ids)
        return y + self.weight.sum() if self.training else y


class LM(nn.Module):
    """``ids [m, T] -> logits [m, T, V]``; ``len()`` keeps torch.fx out (module surgery)."""

    def __init__(self, tok: nn.Embedding, tied: bool, lin: type = nn.Linear):
        super().__init__()
        self.tok, self.pos = tok, OffsetPositions(8, D)
        self.mlp = lin(D, D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, ids, attention_mask):
        h = self.tok(ids) + self.pos(attention_mask, 0)
        h = h[: len(h)]
        return self.head(torch.tanh(self.mlp(h)))


def _data(m=4, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (m, T), generator=g), torch.randint(0, V, (m, T), generator=g)


class Call(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, torch.ones_like(ids))


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, V), y.reshape(-1))


def test_forward_is_linear_forms():
    assert forward_is_linear(MatmulLinear(3, 4)) and forward_is_linear(MatmulLinear(3, 4, bias=False))
    assert not forward_is_linear(ScaledLinear(3, 4))
    assert match_module(MatmulLinear(3, 4)) == ("linear", "")
    assert "overrides Linear.forward" in match_module(ScaledLinear(3, 4))[1]


def test_overriding_lookup_proofs():
    assert overriding_lookup(OffsetPositions(8, D)) == ""
    assert overriding_lookup(ScaledTokens(V, D)) == ""
    assert "not provably exact" in overriding_lookup(DoubleRead(V, D))
    assert "not provably exact" in overriding_lookup(TrainOnlyRead(V, D).eval())
    assert overriding_lookup(nn.Embedding(V, D)) != ""  # the base class is matched as itself


@pytest.mark.parametrize("tok,tied", [(nn.Embedding, False), (ScaledTokens, False), (ScaledTokens, True)])
def test_overriding_layers_exact(tok, tied):
    torch.manual_seed(0)
    net = Call(LM(tok(V, D), tied, MatmulLinear)).double()
    orig = copy.deepcopy(net)
    ids, y = _data()
    pm = prepare(net, example_inputs=(ids[:2],))
    assert report(pm).fraction_params == 1.0, str(report(pm))
    covered = get_info(pm).covered
    assert covered["model.pos.weight"] == "model.pos"
    if tied:
        assert covered["model.tok.weight"] == "model.head"
    check_covered_layers(orig, pm, ids, y, loss_fn=_loss)


def test_lookup_reading_weight_twice_is_replayed():
    """Not a lookup layer (it reads its weight twice), but replayed per sample: exact."""
    torch.manual_seed(0)
    net = Call(LM(DoubleRead(V, D), False)).double()
    orig = copy.deepcopy(net)
    ids, y = _data()
    pm = prepare(net, example_inputs=(ids[:2],))
    assert get_info(pm).covered["model.tok.weight"] == "model.tok.weight", str(report(pm))
    assert "model.pos.weight" in get_info(pm).covered
    check_covered_layers(orig, pm, ids, y, loss_fn=_loss)


class MLMHead(nn.Module):
    """BERT's prediction head: the decoder's weight tied to the word embedding, its bias
    also registered (unread) on the head itself."""

    def __init__(self, emb: nn.Embedding):
        super().__init__()
        self.decoder = nn.Linear(D, V)
        self.bias = self.decoder.bias
        self.decoder.weight = emb.weight

    def forward(self, h):
        return self.decoder(torch.tanh(h))


class MLM(nn.Module):
    def __init__(self, scaled: bool):
        super().__init__()
        self.tok = (ScaledTokens if scaled else nn.Embedding)(V, D)
        self.head = MLMHead(self.tok)

    def forward(self, ids):
        h = self.tok(ids)
        h = h[: len(h)]
        return self.head(h)


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("strategy", ["factor", "materialize"])
def test_tied_decoder_with_bias_exact(scaled, strategy):
    """The lookup adds nothing to the decoder's bias gradient (per-sample, Gram, Jv, Jᵀc),
    and one TENGraD step equals dense block NGD on ``[W, b]``, in both strategies."""
    import tengrad_fx
    from testing.oracle import dense_layer_updates

    torch.manual_seed(1)
    net = MLM(scaled).double()
    with torch.no_grad():
        net.head.bias.normal_()
    orig = copy.deepcopy(net)
    ids, y = _data(seed=2)
    pm = prepare(net, example_inputs=(ids[:2],))
    assert report(pm).fraction_params == 1.0, str(report(pm))
    assert get_info(pm).covered["tok.weight"] == get_info(pm).covered["head.bias"] == "head.decoder"
    check_covered_layers(copy.deepcopy(orig), pm, ids, y, loss_fn=_loss)
    pm.zero_grad()
    opt = tengrad_fx.TENGraD(pm, lr=1.0, damping=0.1, momentum=0.0, strategy=strategy, curvature_every=1,
                             kl_clip=None)
    _loss(pm(ids), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in pm.named_parameters()}
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    opt.step()
    ref = dense_layer_updates(orig, ids, y, _loss, grads, 0.1, get_info(pm).covered)
    for n, p in pm.named_parameters():
        err = ((before[n] - p.detach() - ref[n]).norm() / ref[n].norm()).item()
        assert err < 1e-8, (n, err)


def test_bias_read_by_its_other_holder_is_replayed():
    """A near miss: the head adds its (shared) bias once more itself. Not one layer with the
    decoder, but replayed per sample with the head: exact."""

    class Reads(MLMHead):
        def forward(self, h):
            return self.decoder(torch.tanh(h)) + self.bias

    torch.manual_seed(0)
    net = MLM(False).double()
    net.head.__class__ = Reads
    orig = copy.deepcopy(net)
    ids, y = _data()
    pm = prepare(net, example_inputs=(ids[:2],))
    assert get_info(pm).covered["head.bias"] == "head.bias" and "_tengrad_replay" in pm.head.__dict__
    check_covered_layers(orig, pm, ids, y, loss_fn=_loss)


class GatedRMS(nn.Module):
    """RMSNorm-shaped, but its forward takes a gate (Mamba-2's gated norm)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.variance_epsilon = 1e-6

    def forward(self, x, gate=None):
        if gate is not None:
            x = x * torch.sigmoid(gate)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_gated_rmsnorm_is_replayed_and_keeps_outputs():
    """Matched by structure alone it would be run as a plain RMSNorm, its gate dropped: not a
    norm layer, but replayed per sample, exact."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.n = nn.Linear(4, 6), GatedRMS(6)

        def forward(self, x):
            h = self.a(x)
            h = h[: len(h)]
            return self.n(h, gate=h.flip(-1))

    torch.manual_seed(0)
    net = Net().double()
    orig = copy.deepcopy(net)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    want = net(x)
    assert match_module(net.n)[0] is None and "gate" in match_module(net.n)[1]
    pm = prepare(net, example_inputs=(x[:2],))
    assert torch.allclose(pm(x), want, rtol=0, atol=1e-14)
    assert get_info(pm).covered["n.weight"] == "n.weight"
    check_covered_layers(orig, pm, x, torch.randn(3, 5, 6, dtype=torch.float64), loss_fn=F.mse_loss)
