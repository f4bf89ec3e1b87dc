"""TENGraD in a Hugging Face ``Trainer`` (a BERT-style sequence classifier).

The model is prepared with a batch of keyword inputs (``prepare(model, example_inputs={...})``;
transformers models are untraceable, so ``prepare`` swaps the covered modules' classes in
place), and the optimizer goes to the Trainer as ``optimizers=(opt, None)``. The Trainer's
loop needs nothing else: with ``fisher="mc"`` the sampled backward runs inside its
``loss.backward()`` on curvature steps. The sequences have their own lengths and a padding
collator (:func:`pad`) pads each batch; the optimizer reads the positions the loss scores
from the call (``labels=``, ``attention_mask=``), so the padding is never sampled.

The task is synthetic (no download): classify a token sequence by whether token 1 occurs
more often than token 2. The BERT is tiny and randomly initialized from a config.

    python examples/hf_trainer.py --steps 200
    python examples/hf_trainer.py --smoke
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import tengrad_fx


class CountingTask(torch.utils.data.Dataset):
    """Token sequences (vocabulary ``vocab``, length ``length``, the tail padded) labelled
    1 when token 1 occurs more often than token 2."""

    def __init__(self, n: int, length: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, length), generator=g)
        self.ids[torch.rand(n, length, generator=g) < 0.3] = 1
        self.ids[torch.rand(n, length, generator=g) < 0.3] = 2
        lengths = torch.randint(length // 2, length + 1, (n,), generator=g)
        self.mask = (torch.arange(length) < lengths[:, None]).long()
        self.ids = self.ids * self.mask                       # 0 = [PAD]
        self.labels = ((self.ids == 1).sum(1) > (self.ids == 2).sum(1)).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        """Sequence ``i`` without its padding (the collator pads each batch)."""
        n = int(self.mask[i].sum())
        return {"input_ids": self.ids[i, :n], "attention_mask": self.mask[i, :n], "labels": self.labels[i]}


def pad(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The padding collator: ``input_ids`` and ``attention_mask`` right-padded with 0 to the
    batch's longest sequence (for a token-level loss, pad ``labels`` with -100 as well)."""
    n = max(r["input_ids"].numel() for r in rows)
    out = {k: torch.stack([torch.nn.functional.pad(r[k], (0, n - r[k].numel())) for r in rows])
           for k in ("input_ids", "attention_mask")}
    return {**out, "labels": torch.stack([r["labels"] for r in rows])}


def build_model(smoke: bool) -> BertForSequenceClassification:
    size = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64) if smoke else \
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = BertConfig(vocab_size=16, max_position_embeddings=64, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **size)
    return BertForSequenceClassification(config)


def main(argv: Optional[Sequence[str]] = None) -> Trainer:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--smoke", action="store_true", help="tiny model and data, CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    length = 12 if args.smoke else 32
    train = CountingTask(256 if args.smoke else 8192, length, vocab=16, seed=args.seed)
    model = build_model(args.smoke)
    example = {k: v for k, v in pad([train[0], train[1]]).items() if k != "labels"}
    model = tengrad_fx.prepare(model, example_inputs=example)   # the same object, its layers capture
    # MC Fisher, curvature every 20 steps (a transformer's curvature drifts faster than a
    # small CNN's), KL clip 0.01
    opt = tengrad_fx.make_optimizer("tengrad", model, lr=args.lr, damping=0.1, weight_decay=1e-4,
                                    fisher="mc", curvature_every=20, kl_clip=0.01)

    targs = TrainingArguments(output_dir="/tmp/hf_trainer_tengrad", max_steps=args.steps,
                              per_device_train_batch_size=16 if args.smoke else args.batch_size,
                              lr_scheduler_type="constant", logging_steps=max(1, args.steps // 10),
                              save_strategy="no", report_to=[], use_cpu=args.smoke or not torch.cuda.is_available(),
                              seed=args.seed, disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=train, optimizers=(opt, None), data_collator=pad)
    trainer.train()

    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    with torch.no_grad():
        batch = {k: v[:512].to(model.device) for k, v in (("input_ids", train.ids), ("attention_mask", train.mask),
                                                               ("labels", train.labels))}
        acc = (model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits.argmax(-1)
               == batch["labels"]).float().mean().item()
    print(f"steps {trainer.state.global_step}  loss {losses[0]:.3f} -> {losses[-1]:.3f}  train accuracy {acc:.3f}")
    return trainer


if __name__ == "__main__":
    main()
