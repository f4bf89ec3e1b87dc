"""Resume of TENGraD with ``curvature_every = T > 1`` is bit-identical: the state dict
carries the last curvature step's records when the next step reuses them
(:mod:`tengrad_fx.optim.tengrad.resume`), and nothing when it does not; with the MC
Fisher it carries the sampling generator, so the resumed run does not depend on the
global RNG."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD

STEPS = 7


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(),
                         nn.Flatten(), nn.Linear(3 * 5 * 5, 8), nn.ReLU(), nn.Linear(8, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(6, 1, 5, 5, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(STEPS)]


def _setup(net: nn.Module, **kw):
    model = tengrad_fx.prepare(copy.deepcopy(net), example_inputs=(torch.randn(2, 1, 5, 5),))
    return model, TENGraD(model, lr=0.05, damping=0.1, **kw)


def _step(model: nn.Module, opt: TENGraD, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    out = model(x)
    opt.mc_capture(out)
    F.cross_entropy(out, y).backward()
    opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


KW = {
    "T3": dict(curvature_every=3),
    "T4-materialize": dict(curvature_every=4, strategy="materialize"),
    "T4-factor": dict(curvature_every=4, strategy="factor"),
    "T3-mc-klclip": dict(curvature_every=3, fisher="mc", kl_clip=0.01),
}


@pytest.mark.parametrize("name", sorted(KW))
def test_resume_at_every_step_is_bit_identical(name: str) -> None:
    kw = KW[name]
    net, data = _net(), _batches()
    torch.manual_seed(11)
    model, opt = _setup(net, **kw)
    for x, y in data:
        _step(model, opt, x, y)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    T = kw["curvature_every"]
    for cut in range(1, STEPS):
        torch.manual_seed(11)
        m1, o1 = _setup(net, **kw)
        for x, y in data[:cut]:
            _step(m1, o1, x, y)
        saved = _roundtrip({"model": m1.state_dict(), "opt": o1.state_dict()})
        assert ("curvature" in saved["opt"]) == (cut % T != 0), cut  # only when the next step reuses
        m2, o2 = _setup(net, **kw)
        m2.load_state_dict(saved["model"])
        o2.load_state_dict(saved["opt"])
        torch.manual_seed(12345)  # the MC labels come from the optimizer's saved generator, not the global RNG
        for x, y in data[cut:]:
            _step(m2, o2, x, y)
        got = m2.state_dict()
        for k in want:
            assert torch.equal(got[k], want[k]), (name, cut, k)
        assert o2.counters == opt.counters


def test_no_curvature_for_t1_and_size_bound() -> None:
    net, data = _net(), _batches()
    model, opt = _setup(net, curvature_every=1)
    _step(model, opt, *data[0])
    assert "curvature" not in opt.state_dict()
    model, opt = _setup(net, curvature_every=5)
    _step(model, opt, *data[0])
    curv = opt.state_dict()["curvature"]
    saved = sum(t.numel() * t.element_size() for recs in curv["records"].values() for site in recs
                for r in site for t in (r["I"], r["G"], r["P"], r["Gsum"]) if t is not None)
    store = tengrad_fx.get_info(model).store
    live = sum(t.numel() * t.element_size() for recs in store.records.values() for r in recs
               for t in (r.I, r.G, r.P, r.Gsum) if t is not None)
    assert 0 < saved == live  # exactly the records the reuse steps read, nothing more
