"""Gradient accumulation under real trainers, float64 on CPU: ``transformers.Trainer``
(``gradient_accumulation_steps=2``, tiny random BERT that computes its own loss) and
``pytorch_lightning.Trainer`` (``accumulate_grad_batches=2``) end with the parameters of a
plain loop that accumulates the same micro-batches (each loss divided by 2) before each
``opt.step()``, with no extra call; the curvature of every step is the union of its two
micro-batches (empirical and MC Fisher; MC labels from the optimizer's seeded generator)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tengrad_fx

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

STEPS, ACCUMULATE, BS = 3, 2, 8
TOL = 1e-10


def _optimizer(model: nn.Module, fisher: str) -> tengrad_fx.TENGraD:
    opt = tengrad_fx.TENGraD(model, lr=0.3, damping=0.1, momentum=0.5, curvature_every=1, fisher=fisher,
                             kl_clip=0.05)
    opt.seed_mc(0)
    return opt


def _plain_loop(model: nn.Module, opt: tengrad_fx.TENGraD, batches: list[Any],
                loss_of: Callable[[nn.Module, Any], torch.Tensor]) -> None:
    """``STEPS`` steps over ``batches`` in order, ``ACCUMULATE`` micro-batches each, each loss / ACCUMULATE."""
    for s in range(STEPS):
        for b in batches[s * ACCUMULATE:(s + 1) * ACCUMULATE]:
            (loss_of(model, b) / ACCUMULATE).backward()
        opt.step()
        opt.zero_grad()
    assert opt.curvature_steps == STEPS


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        err = ((p - q).norm() / q.norm()).item()
        assert err <= TOL, (name, err)


# --------------------------------------------------------------------------- Hugging Face
def _bert(transformers: Any, data: list[dict[str, torch.Tensor]]) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16, num_labels=2,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForSequenceClassification(config).double()
    example = {k: torch.stack([data[0][k], data[1][k]]) for k in ("input_ids", "attention_mask")}
    return tengrad_fx.prepare(model, example_inputs=example)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_hf_trainer_accumulation_equals_plain_loop(tmp_path: Path, fisher: str) -> None:
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(1, 12, (STEPS * ACCUMULATE * BS, 8), generator=torch.Generator().manual_seed(0))
    labels = ((ids == 1).sum(1) > (ids == 2).sum(1)).long()
    data = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": t} for i, t in zip(ids, labels)]

    class InOrder(transformers.Trainer):  # the batches in dataset order, as the plain loop takes them
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    model = _bert(transformers, data)
    opt = _optimizer(model, fisher)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=BS,
                                          gradient_accumulation_steps=ACCUMULATE, max_grad_norm=0.0,
                                          lr_scheduler_type="constant", use_cpu=True, report_to=[],
                                          save_strategy="no", disable_tqdm=True, seed=0)
    trainer = InOrder(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    # BERT's forward takes **kwargs but its loss ignores num_items_in_batch: the Trainer would then
    # divide by nothing; told so, it divides each micro-batch's loss by gradient_accumulation_steps
    trainer.model_accepts_loss_kwargs = False
    trainer.train()
    assert opt.counters == {"step": STEPS, "skipped": 0, "uncaptured": 0}
    assert {lay.m for lay in tengrad_fx.covered_layers(model)} == {ACCUMULATE * BS}  # the last step's union

    plain = _bert(transformers, data)
    batches = [{k: torch.stack([d[k] for d in data[i:i + BS]]) for k in data[0]} for i in range(0, len(data), BS)]
    _plain_loop(plain, _optimizer(plain, fisher), batches, lambda m, b: m(**b)["loss"])
    _assert_same(model, plain)


# --------------------------------------------------------------------------- Lightning
def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.GroupNorm(1, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
    return tengrad_fx.prepare(net.double(), example_inputs=(torch.randn(2, 1, 6, 6, dtype=torch.float64),))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS * ACCUMULATE * BS, 1, 6, 6, generator=g, dtype=torch.float64)
    y = x[:, 0, :4, :].sum(-1).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=BS, shuffle=False)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_lightning_accumulation_equals_plain_loop(tmp_path: Path, fisher: str) -> None:
    pl = pytest.importorskip("pytorch_lightning")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(self.net, fisher)

    module = Module()
    pl.Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, accelerator="cpu", logger=False,
               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
               default_root_dir=str(tmp_path)).fit(module, _loader())
    opt = module.trainer.optimizers[0]
    assert opt.counters == {"step": STEPS, "skipped": 0, "uncaptured": 0}
    assert {lay.m for lay in tengrad_fx.covered_layers(module.net)} == {ACCUMULATE * BS}  # the last step's union

    plain = _net()
    _plain_loop(plain, _optimizer(plain, fisher), list(_loader()), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    _assert_same(module.net, plain)
