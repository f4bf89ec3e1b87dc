"""Small Hugging Face models (random weights, float64, no dropout) behind a positional
call, and the exactness checks of their covered layers against ``torch.func``."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from tengrad_fx import TENGraD, get_info, prepare
from testing.oracle import check_covered_layers, dense_layer_updates

transformers = __import__("pytest").importorskip("transformers")
V = 64


class Call(nn.Module):
    """``model(**{name: x, **extra}).logits`` for a positional ``x`` (what the oracle calls)."""

    def __init__(self, model: nn.Module, name: str = "input_ids", **extra: Tensor) -> None:
        super().__init__()
        self.model, self.name, self.extra = model, name, extra
        self.train(model.training)

    def forward(self, x: Tensor) -> Tensor:
        extra = {k: v.expand(x.shape[0], *v.shape[1:]) for k, v in self.extra.items()}
        return self.model(**{self.name: x}, **extra).logits


def build(name: str, layers: int = 1, width: int = 16, **cfg: Any) -> nn.Module:
    """A small model of the family ``name`` (``layers`` blocks of ``width`` features) in
    float64, eval mode (dropout off)."""
    h, f = width, 2 * width
    t = transformers
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "bert":
            m = t.BertForSequenceClassification(t.BertConfig(
                vocab_size=V, hidden_size=h, num_hidden_layers=layers, num_attention_heads=2, intermediate_size=f,
                max_position_embeddings=16, num_labels=3, **cfg))
        elif name == "gpt2":
            m = t.GPT2LMHeadModel(t.GPT2Config(vocab_size=V, n_embd=h, n_layer=layers, n_head=2, n_positions=16,
                                               bos_token_id=0, eos_token_id=0, **cfg))
        elif name == "t5":
            m = t.T5ForConditionalGeneration(t.T5Config(
                vocab_size=V, d_model=h, d_kv=h // 2, d_ff=f, num_layers=layers, num_heads=2,
                decoder_start_token_id=0, pad_token_id=0, **cfg))
        elif name == "llama":
            m = t.LlamaForCausalLM(t.LlamaConfig(
                vocab_size=V, hidden_size=h, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                intermediate_size=f, max_position_embeddings=16, **cfg))
        elif name == "vit":
            m = t.ViTForImageClassification(t.ViTConfig(
                image_size=8, patch_size=4, num_channels=3, hidden_size=h, num_hidden_layers=layers,
                num_attention_heads=2, intermediate_size=f, num_labels=3, **cfg))
        else:
            raise ValueError(name)
    return m.double().eval()


def token_loss(out: Tensor, y: Tensor) -> Tensor:
    """Cross-entropy over every position of ``out [m, T, V]`` (or ``[m, C]``)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def check_exact(wrapper: Call, x: Tensor, y: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor] = token_loss,
                damping: float = 0.05, tol: float = 1e-10) -> nn.Module:
    """Prepare ``wrapper`` on ``x[:2]``; every covered layer's per-sample gradients, Gram,
    ``Jv``, ``Jᵀc`` equal ``torch.func``'s, and one TENGraD step (lr 1, no momentum) moves
    each covered parameter by dense block NGD's ``(F + αI)⁻¹ g`` and each fallback by ``g``
    (relative error ``tol``, and ``100·tol`` for the step)."""
    orig = copy.deepcopy(wrapper)
    model = prepare(wrapper, example_inputs=(x[:2],))
    check_covered_layers(orig, model, x, y, loss_fn=loss_fn, tol=tol)
    model.zero_grad()
    opt = TENGraD(model, lr=1.0, damping=damping, momentum=0.0, curvature_every=1, kl_clip=None)
    loss_fn(model(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    covered = get_info(model).covered
    ref = dense_layer_updates(orig, x, y, loss_fn, grads, damping, covered)
    want = {n: ref[n] if n in covered else g for n, g in grads.items()}
    floor = 1e-6 * max(w.norm().item() for w in want.values())  # e.g. a key bias: its gradient is ~0
    for n, p in model.named_parameters():
        if n in want:
            err = ((before[n] - p.detach() - want[n]).norm() / max(want[n].norm().item(), floor)).item()
            assert err <= 100 * tol, f"{n}: rel err {err:.2e}"
    return model
