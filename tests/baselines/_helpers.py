"""Shared models and independent float64 references for the baseline-optimizer tests.

References never touch the capture store: layer inputs and output gradients come from a
plain forward of the UNPREPARED model, module by module, with ``retain_grad`` on each
covered layer's output; patches come from ``F.unfold``.
"""
from __future__ import annotations

import copy
import gzip
import os
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def cnn(bias2: bool = True) -> nn.Sequential:
    """Conv (stride 2, padding 1), grouped dilated conv, Linear; input ``[B, 3, 9, 9]``."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(),                    # -> 4x5x5
        nn.Conv2d(4, 6, 2, groups=2, dilation=2, bias=bias2), nn.Tanh(),  # -> 6x3x3
        nn.Flatten(), nn.Linear(6 * 3 * 3, 5),
    ).double()


def batch(m: int, seed: int = 0, shape: tuple[int, ...] = (3, 9, 9), classes: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, *shape, generator=g, dtype=torch.float64), torch.randint(0, classes, (m,), generator=g)


def prepared(net: nn.Module, x: torch.Tensor) -> tuple[nn.Module, nn.Module]:
    """(pristine unprepared copy, prepared model)."""
    template = copy.deepcopy(net)
    return template, tengrad_fx.prepare(net, example_inputs=(x[:2],))


def snapshot(template: nn.Module, model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(template)
    ref.load_state_dict(model.state_dict())
    return ref


def reference_io(seq: nn.Sequential, x: torch.Tensor, y: torch.Tensor):
    """Run ``seq`` module by module; returns ``{index: (input, output grad, module)}`` for
    every Conv2d/Linear (output grads of the mean cross-entropy, with its 1/m) and
    ``{param name: grad}``."""
    seq.zero_grad()
    h, keep = x, {}
    for i, mod in enumerate(seq):
        inp = h
        h = mod(h)
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            h.retain_grad()
            keep[i] = (inp.detach(), h, mod)
    F.cross_entropy(h, y).backward()
    io = {i: (inp, out.grad.detach(), mod) for i, (inp, out, mod) in keep.items()}
    return io, {n: p.grad.detach().clone() for n, p in seq.named_parameters()}


def explicit_factors(mod: nn.Module, inp: torch.Tensor, gout: torch.Tensor):
    """Per group ``(A [g, f+b, f+b], G [g, o, o])``: A = mean over (samples, positions) of
    ``ã ãᵀ`` from ``F.unfold``; G = mean over samples, sum over positions of ``ğ ğᵀ``,
    ``ğ = m·(output grad)``. Also Wang's (KFAC-Pytorch) per-group factors."""
    m = inp.shape[0]
    if isinstance(mod, nn.Linear):
        cols = inp.reshape(m, -1, inp.shape[-1])                            # [m, S, f]
        g, go = 1, (m * gout).reshape(m, -1, gout.shape[-1])
    else:
        g = mod.groups
        cols = F.unfold(inp, mod.kernel_size, dilation=mod.dilation, padding=mod.padding,
                        stride=mod.stride).transpose(1, 2)                 # [m, S, c·k·k]
        go = (m * gout).flatten(2).transpose(1, 2)                          # [m, S, c_out]
    S = cols.shape[1]
    A, G, Aw, Gw = [], [], [], []
    f, o = cols.shape[2] // g, go.shape[2] // g
    for k in range(g):
        a = cols[:, :, k * f:(k + 1) * f].reshape(m * S, f)
        if mod.bias is not None:
            a = torch.cat([a, torch.ones(m * S, 1, dtype=a.dtype)], 1)
        b = go[:, :, k * o:(k + 1) * o].reshape(m * S, o)
        A.append(a.T @ a / (m * S))
        G.append(b.T @ b / m)
        aw = a / S                                   # KFAC-Pytorch ComputeCovA.conv2d
        Aw.append(aw.T @ aw / m)
        bw = (b / m) * m * S                         # ComputeCovG.conv2d, batch_averaged
        Gw.append(bw.T @ bw / (m * S))
    return torch.stack(A), torch.stack(G), torch.stack(Aw), torch.stack(Gw)


def grad_matrix(mod: nn.Module, grads: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """``[g, o, f+b]`` from reference grads."""
    g = getattr(mod, "groups", 1)
    W = grads[f"{prefix}.weight"]
    o = W.shape[0] // g
    mat = W.reshape(g, o, -1)
    if mod.bias is not None:
        mat = torch.cat([mat, grads[f"{prefix}.bias"].reshape(g, o, 1)], 2)
    return mat


def step_delta(model: nn.Module, opt: torch.optim.Optimizer, closure=None) -> dict[str, torch.Tensor]:
    """``{name: p_before - p_after}`` over one step (= ``u`` with lr=1, no momentum/wd)."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step(closure)
    return {n: before[n] - p.detach() for n, p in model.named_parameters()}


def split_matrix(mod: nn.Module, mat: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    f = mod.weight[0].numel()
    out = {f"{prefix}.weight": mat[..., :f].reshape(mod.weight.shape)}
    if mod.bias is not None:
        out[f"{prefix}.bias"] = mat[..., f].reshape(mod.bias.shape)
    return out


def fmnist(n: int = 1024) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """First ``n`` training images (normalized, ``[n, 1, 28, 28]``) and labels, or None."""
    ip = os.path.join(FMNIST_DIR, "train-images-idx3-ubyte.gz")
    lp = os.path.join(FMNIST_DIR, "train-labels-idx1-ubyte.gz")
    if not (os.path.exists(ip) and os.path.exists(lp)):
        return None
    with gzip.open(ip, "rb") as fh:
        imgs = np.frombuffer(fh.read(), np.uint8, offset=16).reshape(-1, 28, 28)[:n]
    with gzip.open(lp, "rb") as fh:
        labels = np.frombuffer(fh.read(), np.uint8, offset=8)[:n]
    x = torch.from_numpy(imgs.astype(np.float32) / 255.0).unsqueeze(1)
    x = (x - 0.2860) / 0.3530
    return x, torch.from_numpy(labels.astype(np.int64))


def need_fmnist() -> tuple[torch.Tensor, torch.Tensor]:
    data = fmnist()
    if data is None:
        pytest.skip(f"Fashion-MNIST not found under {FMNIST_DIR} (apt-get install dataset-fashion-mnist)")
    return data
