"""TENGraD under a real ``pytorch_lightning.Trainer`` (CPU, automatic optimization).

* ``make_optimizer("tengrad", ..., dataset="fashion-mnist")`` (MC Fisher, curvature every
  100 steps, KL clip 0.01) returned by ``configure_optimizers`` trains with no extra call:
  the sampled backward runs inside Lightning's closure (``LightningOptimizer.step``);
* a run of N steps and a run resumed by a new Trainer from its checkpoint at N/2, in a
  freshly seeded process state, end with bit-identical parameters (curvature every 3
  steps: the resumed half samples MC labels, from the optimizer's saved generator). The
  batch of a step is picked by ``global_step`` (the loader is only the clock): a
  Lightning resume with a plain ``DataLoader`` replays the epoch's first batch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tengrad_fx

pl = pytest.importorskip("pytorch_lightning")
ModelCheckpoint = pl.callbacks.ModelCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class _Module(pl.LightningModule):
    def __init__(self, opt_kw: dict[str, Any], by_step: bool = False):
        super().__init__()
        self.by_step = by_step
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
        self.net = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 1, 6, 6),))
        self.opt_kw = opt_kw
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = _BATCHES[self.global_step % len(_BATCHES)] if self.by_step else batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return tengrad_fx.make_optimizer("tengrad", self.net, dataset="fashion-mnist", **self.opt_kw)


def _data(n_batches: int, bs: int = 16) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n_batches * bs, 1, 6, 6, generator=g)
    y = x[:, 0, :4, :].sum(-1).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=bs, shuffle=False)


_BATCHES = list(_data(8))


def _trainer(max_steps: int, root: Path) -> Any:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=True,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root))


def test_automatic_optimization_paper_settings(tmp_path: Path) -> None:
    module = _Module({"lr": 0.05})
    before = [p.detach().clone() for p in module.parameters()]
    _trainer(8, tmp_path).fit(module, _data(4))
    opt = module.trainer.optimizers[0]
    assert isinstance(opt, tengrad_fx.TENGraD) and opt.fisher == "mc" and opt.curvature_every == 100
    assert opt.kl_clip == 0.01
    assert opt.counters == {"step": 8, "skipped": 0, "uncaptured": 0} and opt.curvature_steps == 1
    assert all(torch.isfinite(torch.tensor(module.losses)))
    assert sum(module.losses[-4:]) < sum(module.losses[:4])  # the same 4 batches, one epoch apart
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_checkpoint_resume_is_bit_identical(tmp_path: Path) -> None:
    """Straight: 8 steps (two epochs of 4 batches), a checkpoint at the first epoch's end;
    resumed: a new Trainer from that checkpoint, with the global RNG freshly seeded."""
    kw = {"lr": 0.05, "curvature_every": 3}  # curvature at steps 0, 3, 6: the last one after the resume
    n, half = 8, 4
    pl.seed_everything(0, verbose=False)
    straight = _Module(kw, by_step=True)
    ckpt_cb = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, every_n_epochs=1, save_last=False)
    trainer = _trainer(n, tmp_path / "a")
    trainer.callbacks.append(ckpt_cb)
    trainer.fit(straight, _data(half))
    ckpt = tmp_path / f"epoch=0-step={half}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())

    pl.seed_everything(0, verbose=False)  # a restarted script: the global RNG is not where it was at step 4
    resumed = _Module(kw, by_step=True)
    _trainer(n, tmp_path / "c").fit(resumed, _data(half), ckpt_path=str(ckpt))
    opt = resumed.trainer.optimizers[0]
    assert opt.counters["step"] == n and opt.curvature_steps == 3
    assert resumed.losses == straight.losses[half:]
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
