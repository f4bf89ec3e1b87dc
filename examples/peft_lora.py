"""TENGraD on LoRA adapters (``peft``): natural gradient on the adapters only.

``peft`` freezes the base model and adds low-rank ``lora_A``/``lora_B`` Linear layers;
``prepare`` covers those (each is an ``nn.Linear`` called on per-sample inputs), and the
optimizer takes only the trainable parameters. The base model is a tiny GPT-2 from a
config (random weights); the task is next-token prediction on a synthetic sequence
(every token is the previous one plus 1, modulo the vocabulary).

    python examples/peft_lora.py --steps 100
    python examples/peft_lora.py --smoke
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

import tengrad_fx


def build_model(smoke: bool, vocab: int = 32) -> torch.nn.Module:
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32 if smoke else 64, n_layer=1 if smoke else 2,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    base = GPT2LMHeadModel(config)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                      fan_in_fan_out=True)  # GPT-2's Conv1D layers store their weight transposed
    return get_peft_model(base, lora)


def batch(n: int, length: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, vocab, (n, 1), generator=g)
    return (start + torch.arange(length)) % vocab


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--smoke", action="store_true", help="tiny model and data")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    vocab, length = 32, 16
    model = build_model(args.smoke, vocab)
    model.print_trainable_parameters()
    model = tengrad_fx.prepare(model, example_inputs={"input_ids": batch(2, length, vocab, g)})
    print(tengrad_fx.report(model))            # the lora_A / lora_B layers are covered
    # logits [B, L, V]: the MC Fisher samples one token per position
    opt = tengrad_fx.make_optimizer("tengrad", model, lr=args.lr, damping=0.1, fisher="mc",
                                    curvature_every=10, kl_clip=0.01)

    losses = []
    for _ in range(args.steps):
        ids = batch(8 if args.smoke else args.batch_size, length, vocab, g)
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    print(f"steps {len(losses)}  loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"model": model, "optimizer": opt, "losses": losses}


if __name__ == "__main__":
    main()
