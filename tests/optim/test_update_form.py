"""The push-through form is used only when p.grad is the captured batch's gradient."""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 5)).double()


def _clip(pm: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    torch.nn.utils.clip_grad_norm_(pm.parameters(), 0.01)
    return loss


def _l2(pm: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    loss = loss + 0.05 * sum((p ** 2).sum() for p in pm.parameters())
    loss.backward()
    return loss


@pytest.mark.parametrize("modify", [_clip, _l2], ids=["clip_grad_norm", "l2_in_loss"])
def test_modified_gradient_uses_woodbury(modify: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    x = torch.randn(6, 2, 6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.arange(6) % 5
    params = {}
    for form in ("auto", "woodbury"):
        pm = tengrad_fx.prepare(copy.deepcopy(_net()), example_inputs=(x[:2],))
        opt = tengrad_fx.TENGraD(pm, lr=1.0, damping=0.1, momentum=0.0, update_form=form, curvature_every=1,
                                 kl_clip=None)
        for _ in range(2):
            opt.zero_grad()
            modify(pm, F.cross_entropy(pm(x), y))
            opt.step()
        params[form] = torch.cat([p.detach().flatten() for p in pm.parameters()])
    assert (params["auto"] - params["woodbury"]).abs().max().item() < 1e-10


def test_step_without_gradients_is_a_no_op() -> None:
    pm = tengrad_fx.prepare(_net(), example_inputs=(torch.randn(2, 2, 6, 6, dtype=torch.float64),))
    opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1)
    before = [p.detach().clone() for p in pm.parameters()]
    opt.step()
    assert opt.counters["skipped"] == 0 and opt.counters["step"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, pm.parameters()))
