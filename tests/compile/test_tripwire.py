"""No path records wrong values silently: with the records' protection broken on purpose
(a compiled program may then reuse a recorded tensor's memory), the fingerprint check
raises before any curvature is read or any parameter moves."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.capture import record_guard

from ._check import prepare
from ._models import batch


def _compiled_backward(name: str = "activations") -> torch.nn.Module:
    _, pm = prepare(name, train=False)
    x, y = batch(name, 8)
    F.cross_entropy(torch.compile(pm)(x), y).backward()
    return pm


def test_broken_protection_raises_at_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_guard, "copy_record_tensor", lambda t: t)  # records alias the program's buffers
    _, pm = prepare("activations", train=False)
    opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.1, curvature_every=1, kl_clip=None)
    x, y = batch("activations", 8)
    F.cross_entropy(torch.compile(pm)(x), y).backward()
    before = [p.detach().clone() for p in pm.parameters()]
    with pytest.raises(record_guard.RecordOverwritten, match=r"layer '[\w.]+': its recorded [IG] changed"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, pm.parameters())), "a parameter moved"


def test_broken_protection_raises_when_curvature_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_guard, "copy_record_tensor", lambda t: t)
    pm = _compiled_backward()
    with pytest.raises(record_guard.RecordOverwritten):
        for layer in tengrad_fx.covered_layers(pm):
            layer.gram()


def test_check_runs_once_per_site_and_shape() -> None:
    """With the protection on, the first compiled capture is verified (no error), later
    ones of the same shapes are not fingerprinted; a new batch size is."""
    _, pm = prepare("activations", train=False)
    store = tengrad_fx.get_info(pm).store
    fwd = torch.compile(pm)
    for m, fingerprinted in ((8, True), (8, False), (5, True)):
        x, y = batch("activations", m)
        F.cross_entropy(fwd(x), y).backward()
        assert bool(store._watched) == fingerprinted, m
        tengrad_fx.covered_layers(pm)[0].gram()  # verifies
        assert not store._watched


def test_check_always_fingerprints_every_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(record_guard, "CHECK", "always")
    _, pm = prepare("activations", train=False)
    store = tengrad_fx.get_info(pm).store
    fwd = torch.compile(pm)
    for _ in range(2):
        x, y = batch("activations", 8)
        F.cross_entropy(fwd(x), y).backward()
        assert store._watched
        store.verify_records()


def test_eager_records_are_not_copied_or_fingerprinted() -> None:
    """The eager path keeps autograd's tensors as they are (no copy, no check)."""
    _, pm = prepare("activations", train=False)
    x, y = batch("activations", 8)
    out = pm(x)
    F.cross_entropy(out, y).backward()
    store = tengrad_fx.get_info(pm).store
    assert not store._watched and store.records
