"""TENGraD in a PyTorch Lightning module (automatic optimization).

The optimizer is built in ``configure_optimizers`` with the paper's Fashion-MNIST
settings: MC Fisher (labels sampled from the model's prediction), curvature every 100
steps, KL clip 0.01. Lightning's loop needs nothing else: the sampled backward runs by
itself inside ``loss.backward()`` on curvature steps.

    python examples/lightning_mnist.py --steps 300          # Fashion-MNIST from /usr/share/datasets
    python examples/lightning_mnist.py --smoke              # synthetic data, a few seconds
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import tengrad_fx
from tengrad_fx import zoo


def build_model(width: int = 16) -> nn.Module:
    """A small CNN for 1×28×28 images, 10 classes."""
    return nn.Sequential(
        nn.Conv2d(1, width, 5, stride=2), nn.ReLU(),             # 12×12
        nn.Conv2d(width, 2 * width, 3, stride=2), nn.ReLU(),     # 5×5
        nn.Flatten(), nn.Linear(2 * width * 5 * 5, 10),
    )


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module, example: torch.Tensor):
        super().__init__()
        # prepare() keeps the Parameters and state_dict keys: checkpoints look as usual
        self.net = tengrad_fx.prepare(net, example_inputs=(example,))
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # the paper's 3C1F / Fashion-MNIST row: lr 0.003, weight decay 1e-3, damping 0.1,
        # momentum 0.9, fisher="mc", curvature_every=100, kl_clip=0.01
        return tengrad_fx.make_optimizer("tengrad", self.net, dataset="fashion-mnist")


def fashion_mnist(n: int) -> TensorDataset:
    ds = zoo.subset(zoo.get_dataset("fashion-mnist", "train"), n)
    return TensorDataset(ds.x, ds.y)


def synthetic(n: int) -> TensorDataset:
    """Images whose label is the brightest of 10 horizontal bands (learnable in a few steps)."""
    y = torch.randint(0, 10, (n,))
    x = 0.3 * torch.randn(n, 1, 28, 28)
    for i in range(n):
        x[i, 0, 2 + 2 * y[i]: 4 + 2 * y[i]] += 2.0
    return TensorDataset(x, y)


def main(argv: Optional[Sequence[str]] = None) -> Classifier:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="synthetic data, tiny sizes, CPU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    pl.seed_everything(args.seed, verbose=False)
    data = synthetic(256) if args.smoke else fashion_mnist(args.steps * args.batch_size)
    loader = DataLoader(data, batch_size=32 if args.smoke else args.batch_size, shuffle=True)
    module = Classifier(build_model(4 if args.smoke else 16), data.tensors[0][:2])
    trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu" if args.smoke else "auto",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)

    with torch.no_grad():
        x, y = data.tensors
        acc = (module(x[:2048]).argmax(1) == y[:2048]).float().mean().item()
    print(f"steps {len(module.losses)}  loss {module.losses[0]:.3f} -> {module.losses[-1]:.3f}  "
          f"train accuracy {acc:.3f}")
    return module


if __name__ == "__main__":
    main()
