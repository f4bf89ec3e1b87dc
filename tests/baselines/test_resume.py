"""state_dict carries the curvature: a resumed run continues bit-identically."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.optim.registry import make_optimizer

from ._helpers import batch, cnn

KW = {"kfac": dict(curvature_every=2, inverse_every=3),
      "ekfac": dict(curvature_every=2, rescale_every=3, inverse_every=4),
      "kbfgs": dict(curvature_every=2, inverse_every=3), "ngd": dict(curvature_every=2)}


def _run(model, opt, seeds):
    for s in seeds:
        x, y = batch(6, seed=s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name", sorted(KW))
def test_resume_is_exact(name):
    template = cnn()
    x0 = batch(2)[0]
    kw = dict(lr=0.05, damping=0.1, **KW[name])
    model = tengrad_fx.prepare(copy.deepcopy(template), example_inputs=(x0,))
    opt = make_optimizer(name, model, **kw)
    _run(model, opt, range(3))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    _run(model, opt, range(3, 8))

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    model2 = tengrad_fx.prepare(copy.deepcopy(template), example_inputs=(x0,))
    model2.load_state_dict(ck["model"])
    opt2 = make_optimizer(name, model2, **kw)
    opt2.load_state_dict(ck["opt"])
    assert opt2.counters["step"] == 3
    _run(model2, opt2, range(3, 8))
    for (n, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, p2), n
