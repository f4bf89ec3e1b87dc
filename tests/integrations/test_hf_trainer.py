"""TENGraD under a real ``transformers.Trainer`` (CPU, tiny random BERT): the optimizer
passed as ``optimizers=(opt, None)`` (wrapped by accelerate's ``AcceleratedOptimizer``,
stepped after gradient clipping and a LambdaLR) trains with the MC Fisher and no extra
call. The model computes its loss itself (``labels=``): the sampled backward fires at
the output's ``"loss"`` site, and the Trainer keeps the batch keys the prepared model's
``forward`` names."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tengrad_fx

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")


def _tokens(n: int = 64, length: int = 8, vocab: int = 12) -> list[dict[str, torch.Tensor]]:
    """Label 1 when token 1 occurs more often than token 2."""
    ids = torch.randint(1, vocab, (n, length), generator=torch.Generator().manual_seed(0))
    labels = ((ids == 1).sum(1) > (ids == 2).sum(1)).long()
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": t} for i, t in zip(ids, labels)]


def test_trainer_mc_fisher_no_extra_call(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    data = _tokens()
    model = transformers.BertForSequenceClassification(config)
    example = {k: torch.stack([data[0][k], data[1][k]]) for k in ("input_ids", "attention_mask")}
    model = tengrad_fx.prepare(model, example_inputs=example)
    assert tengrad_fx.get_info(model).method == "surgery"
    opt = tengrad_fx.make_optimizer("tengrad", model, lr=0.01, damping=0.1, fisher="mc", curvature_every=3,
                                    kl_clip=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=16,
                                          use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                                          disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()

    assert opt.counters == {"step": 6, "skipped": 0, "uncaptured": 0} and opt.curvature_steps == 2
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), set(before) - set(moved)
