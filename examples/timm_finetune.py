"""TENGraD with a ``timm`` model (ResNet-10-T, random weights) on Fashion-MNIST, resized
to 3×32×32, in a plain PyTorch loop. The MC Fisher's sampled backward runs inside
``loss.backward()`` on curvature steps; nothing else changes in the loop.

    python examples/timm_finetune.py --steps 200     # Fashion-MNIST from /usr/share/datasets
    python examples/timm_finetune.py --smoke          # synthetic images, a few seconds
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

import timm
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import zoo


def build_model(smoke: bool) -> torch.nn.Module:
    # pretrained=False: no download; the 3-channel stem takes the gray image repeated
    return timm.create_model("resnet10t", pretrained=False, num_classes=10,
                             **({"channels": (8, 16, 32, 64)} if smoke else {}))


def to_rgb32(x: torch.Tensor) -> torch.Tensor:
    """[B, 1, 28, 28] -> [B, 3, 32, 32]."""
    return F.interpolate(x, size=32, mode="bilinear", align_corners=False).expand(-1, 3, -1, -1)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="synthetic data, tiny model")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = build_model(args.smoke)
    if args.smoke:   # images whose label is the brightest of 10 bands
        y = torch.randint(0, 10, (256,))
        x = 0.3 * torch.randn(256, 1, 28, 28)
        x[torch.arange(256)[:, None], 0, 2 + 2 * y[:, None] + torch.arange(3)] += 2.0
        train = zoo.ArrayDataset(x=x, y=y, num_classes=10)
    else:
        train = zoo.subset(zoo.get_dataset("fashion-mnist", "train"), 10000)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"

    model = tengrad_fx.prepare(model.to(device), example_inputs=(to_rgb32(train.x[:2]).to(device),))
    opt = tengrad_fx.make_optimizer("tengrad", model, lr=0.01, damping=0.1, weight_decay=1e-3,
                                    fisher="mc", curvature_every=20, kl_clip=0.01)

    losses, step = [], 0
    gen = torch.Generator().manual_seed(args.seed)
    while step < args.steps:
        for x, y in zoo.batches(train, 32 if args.smoke else args.batch_size, shuffle=True, generator=gen):
            x, y = to_rgb32(x).to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if step == args.steps:
                break

    model.eval()
    with torch.no_grad():
        acc = (model(to_rgb32(train.x[:1000]).to(device)).argmax(1).cpu() == train.y[:1000]).float().mean().item()
    print(f"steps {step}  loss {losses[0]:.3f} -> {losses[-1]:.3f}  train accuracy {acc:.3f}")
    return {"model": model, "optimizer": opt, "losses": losses}


if __name__ == "__main__":
    main()
