"""Hugging Face models (real ``transformers``, tiny random configs, float64, module surgery):
every ``Conv1D`` (GPT-2) and every RMSNorm-shaped norm (Llama, T5, Gemma) is covered, its
per-sample gradients equal ``vmap(grad)`` of the model, and one TENGraD step on those
layers equals dense ``(F + αI)⁻¹ g``.

Tolerances: GPT-2 computes in float64 throughout (1e-10). Llama's and T5's norms compute
their statistics in float32 even for a float64 model, and Gemma's ``x̂ ⊙ (1 + γ)`` is
float32 as a whole; the capture reproduces the module's own rounding (its batch gradients
equal the model's to 1e-15, checked here), but ``vmap`` backpropagates those float32 ops
in another order than the batched backward, so the reference itself is only float32
accurate there (1e-6; Gemma, whose weight gradient is float32, 1e-5).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import tengrad_fx
from tengrad_fx import TENGraD, covered_layers, get_info, prepare

transformers = pytest.importorskip("transformers")

M, L, VOCAB = 3, 4, 64


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=32,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
    return transformers.GPT2LMHeadModel(cfg), "Conv1D", 1e-10


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg), "LlamaRMSNorm", 1e-6


def _t5():
    cfg = transformers.T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=VOCAB,
                                dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return transformers.T5ForConditionalGeneration(cfg), "T5LayerNorm", 1e-6


def _gemma():
    cfg = transformers.GemmaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return transformers.GemmaForCausalLM(cfg), "GemmaRMSNorm", 1e-5


def _batch(model, gen):
    ids = torch.randint(1, VOCAB, (M, L), generator=gen)
    kw = dict(input_ids=ids)
    if model.config.is_encoder_decoder:
        kw["decoder_input_ids"] = torch.randint(1, VOCAB, (M, 3), generator=gen)
    return kw, torch.randint(0, VOCAB, (M,), generator=gen)


def _loss(out, y):
    """Cross-entropy of the last position's logits, mean over the batch."""
    return F.cross_entropy(out.logits[:, -1], y)


def _reference(orig, kw, y):
    """``{param name: [m, *shape]}`` by ``vmap(grad)`` of the unprepared model."""
    params = {k: v.detach() for k, v in orig.named_parameters()}

    def loss_i(p, kw_i, y_i):
        out = functional_call(orig, p, args=(), kwargs={k: v.unsqueeze(0) for k, v in kw_i.items()})
        return _loss(out, y_i.unsqueeze(0))

    return vmap(grad(loss_i), in_dims=(None, 0, 0))(params, kw, y)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _build(make, seed):
    torch.manual_seed(seed)
    model, cls, tol = make()
    model = model.double().eval()
    with torch.no_grad():  # norms start at 1 (0 for Gemma): random, so every weight matters
        for mod in model.modules():
            if type(mod).__name__ == cls and "Norm" in cls:
                mod.weight.normal_(0.0, 0.5)
    return model, cls, tol


MODELS = {"gpt2": _gpt2, "llama": _llama, "t5": _t5, "gemma": _gemma}


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_layers_covered_and_exact(name):
    model, cls, tol = _build(MODELS[name], 0)
    orig = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    kw, y = _batch(model, gen)
    pm = prepare(model, example_inputs={k: v[:2] for k, v in kw.items()})
    info = get_info(pm)
    names = {id(p): n for n, p in pm.named_parameters()}
    ours = {mn for mn, mod in pm.named_modules() if type(mod).__name__ == cls}
    assert ours
    for mn in ours:
        for pn, _ in pm.get_submodule(mn).named_parameters(prefix=mn, recurse=False):
            assert info.covered.get(pn) == mn, (pn, info.fallback.get(pn))
    assert f"{cls}:" not in str(tengrad_fx.report(pm))

    _loss(pm(**kw), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in pm.named_parameters()}
    for p in orig.parameters():  # the capture leaves the model's own gradients as they were
        p.grad = None
    _loss(orig(**kw), y).backward()
    for n, p in orig.named_parameters():  # Gemma: its float32 weight gradient, summed in another order
        assert _rel(grads[n], p.grad) <= (1e-6 if name == "gemma" else 1e-12), n
    ref = _reference(orig, kw, y)
    layers = [lay for lay in covered_layers(pm) if lay.name in ours]
    assert len(layers) == len(ours)
    for lay in layers:
        dW, db = lay.per_sample_grads()
        wn = names[id(lay.weight)]
        assert dW.shape == ref[wn].shape and _rel(dW, ref[wn]) <= tol, (wn, _rel(dW, ref[wn]))
        if lay.bias is not None:
            bn = names[id(lay.bias)]
            assert _rel(db, ref[bn]) <= tol, bn


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", ["factor", "materialize"])
def test_hf_tengrad_step_equals_dense_ngd(name, strategy):
    """lr 1, no momentum, no KL clip: ``(F + αI)(θ − θ') = g`` per covered Conv1D / norm,
    ``F = JᵀJ/m`` from the reference per-sample gradients (``materialize``: the backward
    makes ``P``, in the Conv1D weight's ``[d_in, d_out]`` layout)."""
    model, cls, tol = _build(MODELS[name], 2)
    orig = copy.deepcopy(model)
    kw, y = _batch(model, torch.Generator().manual_seed(3))
    pm = prepare(model, example_inputs={k: v[:2] for k, v in kw.items()})
    damping = 0.05
    opt = TENGraD(pm, lr=1.0, damping=damping, momentum=0.0, strategy=strategy, curvature_every=1, kl_clip=None)
    _loss(pm(**kw), y).backward()
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in pm.named_parameters()}
    opt.step()
    ref = _reference(orig, kw, y)
    after = dict(pm.named_parameters())
    info = get_info(pm)
    ours = {mn for mn, mod in pm.named_modules() if type(mod).__name__ == cls}
    for mn in ours:
        pns = sorted((pn for pn in info.covered if info.covered[pn] == mn), key=lambda n: not n.endswith("weight"))
        J = torch.cat([ref[pn].flatten(1) for pn in pns], 1)
        g = torch.cat([grads[pn].flatten() for pn in pns])
        d = torch.cat([(before[pn] - after[pn].detach()).flatten() for pn in pns])
        Fd = J.T @ (J @ d) / M + damping * d  # (F + αI) d = g, without forming the n × n matrix
        assert _rel(Fd, g) <= max(tol, 1e-9), (mn, _rel(Fd, g))
