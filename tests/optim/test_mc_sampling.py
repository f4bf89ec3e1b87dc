"""Where the MC Fisher's labels come from, and where its sampled backward starts, float64.

* a model that computes its own loss (``{"loss", "logits"}`` output, as Hugging Face with
  ``labels=``): a backward from ``out["loss"]`` runs the sampled backward (fx and module
  surgery), bit-identical to an explicit ``mc_capture`` and equal to the dense block NGD
  of the sampled labels;
* the prepared surgery model's ``forward`` keeps the original's signature;
* the labels come from the optimizer's own generator: draws on the global RNG between
  steps change nothing, ``state_dict`` carries it, ``seed_mc`` seeds it;
* ``curvature_steps`` counts the curvature steps.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.step.mc import masked_sum_loss
from testing.tengrad_step import assert_matches, batch, dense_u, full_grad, layer_params, snapshot, step_delta


class _Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class _SelfLoss(_Logits):
    """Returns ``{"loss", "logits"}`` with the loss computed inside."""

    def __init__(self, untraceable: bool):
        super().__init__()
        self.untraceable = untraceable

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.untraceable and x.sum() > -1e9:  # data-dependent control flow: fx cannot trace it
            x = x * 1.0
        logits = self.fc2(torch.tanh(self.fc1(x)))
        return {"logits": logits, "loss": F.cross_entropy(logits, labels)}


def _self_loss_setup(untraceable: bool) -> tuple[nn.Module, nn.Module, tengrad_fx.TENGraD]:
    """(an unprepared logits-only twin, prepared model, optimizer)."""
    torch.manual_seed(0)
    net = _SelfLoss(untraceable).double()
    template = _Logits().double()
    template.load_state_dict(net.state_dict())
    x, y = batch("mlp", 2, 99)
    model = tengrad_fx.prepare(net, example_inputs=(x, y))
    assert tengrad_fx.get_info(model).method == ("surgery" if untraceable else "fx")
    opt = tengrad_fx.TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None,
                             fisher="mc")
    return template, model, opt


@pytest.mark.parametrize("untraceable", [False, True], ids=["fx", "surgery"])
def test_backward_from_the_models_own_loss(untraceable: bool) -> None:
    x, y = batch("mlp", 8, 21)
    deltas = []
    for explicit in (True, False):
        template, model, opt = _self_loss_setup(untraceable)
        ref_model = snapshot(template, model)
        out = model(x, labels=y)
        opt.zero_grad()
        opt.seed_mc(5)
        if explicit:
            opt.mc_capture(out["logits"])
        out["loss"].backward()
        deltas.append(step_delta(model, opt))
        assert opt.curvature_steps == 1
    assert all(torch.equal(deltas[0][k], deltas[1][k]) for k in deltas[0])
    # seed_mc(5): a uniform per sample from a generator seeded with 5, the label its inverse CDF
    u = torch.rand(x.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    t = (torch.softmax(out["logits"].detach(), -1).cumsum(-1) <= u[:, None]).sum(-1)
    assert not torch.equal(t, y)
    g = full_grad(ref_model, x, y, F.cross_entropy)
    assert_matches(deltas[1], dense_u(ref_model, x, t, F.cross_entropy, g, 0.05, layer_params(model)))


def test_surgery_forward_keeps_the_signature() -> None:
    _, model, _ = _self_loss_setup(untraceable=True)
    assert list(inspect.signature(model.forward).parameters) == ["x", "labels"]


def _train(draw_between: bool, steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x, y = batch("mlp", 8, 22)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = tengrad_fx.TENGraD(model, lr=0.3, damping=0.1, fisher="mc", curvature_every=2)
    for step in range(steps):
        if draw_between and step > 0:  # after the generator's seed was drawn
            torch.rand(7)  # dropout, data shuffling, ...: not the MC labels' stream
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert opt.curvature_steps == 3
    return [p.detach().clone() for p in model.parameters()]


def test_labels_do_not_depend_on_other_global_draws() -> None:
    assert all(torch.equal(a, b) for a, b in zip(_train(False), _train(True)))


def test_state_dict_carries_the_generator() -> None:
    _, model, opt = _self_loss_setup(untraceable=False)
    assert "mc_rng" not in opt.state_dict()["state"]["tengrad"]  # nothing drawn yet
    x, y = batch("mlp", 8, 23)
    model(x, labels=y)["loss"].backward()
    opt.step()
    sd = opt.state_dict()
    rng = sd["state"]["tengrad"]["mc_rng"]
    assert rng.dtype == torch.uint8 and rng.device.type == "cpu"
    _, _, other = _self_loss_setup(untraceable=False)
    other.load_state_dict(sd)
    assert torch.equal(other.state_dict()["state"]["tengrad"]["mc_rng"], rng)
    assert "mc_rng" not in other.state["tengrad"]  # held by the sampler, not the optimizer state


@pytest.mark.parametrize("kept", [1, 5, 8, 13])
def test_masked_sum_loss_is_the_mean_scaled_by_a_power_of_two(kept: int) -> None:
    """``masked_sum_loss``: ``2^-e·Σℓ`` with ``2^e`` the least power of two ≥ ``N``, and the
    factor back to the mean over the ``N`` kept positions."""
    g = torch.Generator().manual_seed(kept)
    out = torch.randn(2, 8, 5, generator=g, dtype=torch.float64)
    target = torch.randint(0, 5, (2, 8), generator=g)
    flat = torch.full((16,), -100)
    keep = torch.randperm(16, generator=g)[:kept]
    flat[keep] = target.reshape(-1)[keep]
    loss, mean = masked_sum_loss(out, flat.reshape(2, 8))
    ref = F.cross_entropy(out.reshape(-1, 5), flat)
    total = F.cross_entropy(out.reshape(-1, 5), flat, reduction="sum")
    p = 2.0 ** -math.ceil(math.log2(kept))
    assert float(loss) == float(total) * p
    assert torch.allclose(loss * mean, ref, rtol=1e-14, atol=0)
