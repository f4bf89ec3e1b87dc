"""prepare(): no hooks; same Parameters and state_dict; capture switched off / on;
release of the previous step."""
from __future__ import annotations

import gc
import pathlib
import weakref

import pytest
import torch
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import capturing, covered_layers, get_info, prepare

from ._helpers import CNN, Untraceable, cnn_batch, n_records, prepared_cnn, sq_loss, step

PKG = pathlib.Path(tengrad_fx.__file__).parent


HOOK_CALLS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_full_backward_pre_hook", "register_backward_hook", ".register_hook(",
              "register_module_forward_hook", "register_module_forward_pre_hook",
              "register_module_full_backward_hook", "register_post_accumulate_grad_hook",
              "register_multi_grad_hook")


def test_package_source_registers_no_hooks() -> None:
    files = sorted(PKG.rglob("*.py"))
    assert len(files) >= 8
    offenders = [f"{f.relative_to(PKG)}: {pat}" for f in files for pat in HOOK_CALLS if pat in f.read_text()]
    assert not offenders, offenders


def _global_hook_dicts() -> dict[str, dict]:
    mod = torch.nn.modules.module
    return {n: getattr(mod, n) for n in dir(mod) if n.startswith("_global_") and n.endswith("hooks")
            and isinstance(getattr(mod, n), dict)}


@pytest.mark.parametrize("method", ["fx", "surgery"])
def test_no_hooks_after_prepare_and_training_step(method: str) -> None:
    assert {"_global_forward_hooks", "_global_backward_hooks",
            "_global_forward_pre_hooks"} <= set(_global_hook_dicts())
    if method == "fx":
        model, (x, y) = CNN(), cnn_batch()
        loss_fn = F.cross_entropy
    else:
        model, x, y = Untraceable(), torch.randn(3, 6), torch.randn(3, 3)
        loss_fn = sq_loss
    prepared = prepare(model, example_inputs=(x[:2],))
    assert get_info(prepared).method == method
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        loss_fn(prepared(x), y).backward()
        opt.step()
    assert n_records(prepared) > 0  # it did capture
    for name, mod in list(prepared.named_modules()) + list(model.named_modules()):
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                     "_state_dict_hooks", "_load_state_dict_pre_hooks"):
            assert not getattr(mod, attr), (name, attr)
        assert not getattr(mod, "_is_full_backward_hook", None), name
    for n, d in _global_hook_dicts().items():
        assert not d, n
    for k, p in prepared.named_parameters():  # no tensor hooks either
        assert not p._backward_hooks, k
        assert not getattr(p, "_post_accumulate_grad_hooks", None), k


# --------------------------------------------------------------------------- parameters, state_dict
def test_same_parameters_and_state_dict_keys() -> None:
    model = CNN()
    before = dict(model.named_parameters())
    keys = list(model.state_dict().keys())
    prepared = prepare(model, example_inputs=(cnn_batch()[0][:2],))
    assert list(prepared.state_dict().keys()) == keys
    after = dict(prepared.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert [id(p) for p in prepared.parameters()] == [id(p) for p in model.parameters()]
    assert all(a is b for a, b in zip(prepared.buffers(), model.buffers(), strict=True))
    # covered layers hand out the same objects too
    for layer in covered_layers(prepared):
        assert layer.weight is before[layer.name + ".weight"]


def test_optimizer_built_before_prepare_updates_prepared_model() -> None:
    model = CNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = cnn_batch()
    prepared = prepare(model, example_inputs=(x[:2],))
    start = {k: p.detach().clone() for k, p in prepared.named_parameters()}
    F.cross_entropy(prepared(x), y).backward()
    grads = {k: p.grad.clone() for k, p in prepared.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    opt.step()
    for k, p in prepared.named_parameters():
        torch.testing.assert_close(p.detach(), start[k] - 0.5 * grads[k])
    # the optimizer's own parameter list is the prepared model's
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in prepared.parameters()}


def test_state_dict_loads_both_ways() -> None:
    x, _ = cnn_batch()
    torch.manual_seed(1)
    a = CNN()
    torch.manual_seed(2)
    b = CNN()
    pa = prepare(a, example_inputs=(x[:2],))
    pa.eval()
    b.eval()
    assert not torch.allclose(pa(x), b(x))
    # plain -> prepared
    pa.load_state_dict(b.state_dict())
    torch.testing.assert_close(pa(x), b(x), rtol=0, atol=0)
    # prepared -> plain
    torch.manual_seed(3)
    c = CNN().eval()
    c.load_state_dict(pa.state_dict())
    torch.testing.assert_close(c(x), pa(x), rtol=0, atol=0)
    # strict loading: the same keys, nothing missing nor unexpected
    res = pa.load_state_dict(CNN().state_dict(), strict=True)
    assert not res.missing_keys and not res.unexpected_keys



def test_capturing_false_records_nothing_and_uses_plain_ops() -> None:
    prepared, x, y = prepared_cnn()
    step(prepared, x, y)
    grads_on = [p.grad.clone() for p in prepared.parameters()]
    prepared.zero_grad()
    get_info(prepared).store.clear()
    capturing(prepared, False)
    out = step(prepared, x, y)
    assert get_info(prepared).store.records == {}
    assert "tengrad" not in out.grad_fn.name()  # plain aten op, no capture node in the graph
    for g, p in zip(grads_on, prepared.parameters()):
        torch.testing.assert_close(p.grad, g)  # same gradients
    capturing(prepared, True)
    out = step(prepared, x, y)
    assert "tengrad" in out.grad_fn.name()
    assert n_records(prepared) == len(covered_layers(prepared))


def test_capturing_context_manager_restores_state() -> None:
    prepared, x, y = prepared_cnn()
    store = get_info(prepared).store
    with capturing(prepared, False):
        step(prepared, x, y)
        assert store.records == {}
    step(prepared, x, y)
    assert n_records(prepared) == 4  # conv1, bn, conv2, fc
    capturing(prepared, False)
    store.clear()
    with capturing(prepared, True):
        step(prepared, x, y)
    assert n_records(prepared) == 4  # conv1, bn, conv2, fc
    store.clear()
    step(prepared, x, y)  # off again after the block
    assert store.records == {}


@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode"])
def test_nothing_retained_without_grad(ctx: str) -> None:
    prepared, x, _ = prepared_cnn()
    store = get_info(prepared).store
    cm = torch.no_grad() if ctx == "no_grad" else torch.inference_mode()
    with cm:
        out = prepared(x)
    assert out.grad_fn is None
    assert store.records == {}
    # and a previous step's capture is left alone by a forward that captures nothing
    y = torch.tensor([0, 1, 2])
    step(prepared, x, y)
    recs = dict(store.records)
    with (torch.no_grad() if ctx == "no_grad" else torch.inference_mode()):
        prepared(x)
    assert store.records == recs


def test_eval_mode_still_captures() -> None:
    prepared, x, y = prepared_cnn()
    prepared.eval()
    step(prepared, x, y)
    assert n_records(prepared) == 4  # conv1, bn, conv2, fc
    for layer in covered_layers(prepared):
        assert layer.m == 3


def test_new_capture_releases_previous_step() -> None:
    prepared, x, y = prepared_cnn()
    store = get_info(prepared).store
    step(prepared, x, y)
    site = covered_layers(prepared)[1].spec.sites[0]  # conv2: input is an inner activation
    rec = store.records[site][0]
    refs = [weakref.ref(rec)] + [weakref.ref(t) for t in (rec.I, rec.G, rec.P, rec.Gsum) if t is not None]
    assert len(refs) >= 3
    gen = store.generation
    del rec
    prepared.zero_grad()
    out = prepared(x)  # the next capturing forward: previous records are dropped now
    gc.collect()
    assert all(r() is None for r in refs), "previous step's captured tensors still alive"
    assert store.records == {}
    F.cross_entropy(out, y).backward()
    assert store.generation == gen + 1
    assert n_records(prepared) == 4  # conv1, bn, conv2, fc


