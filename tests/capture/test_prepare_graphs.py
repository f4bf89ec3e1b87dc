"""prepare(): dual train/eval graphs, tensor constants, the module-surgery fallback,
torch.compile."""
from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx import capturing, covered_layers, get_info, prepare

from ._helpers import MLP, Dual, KwargCall, TiedPair, Untraceable, check_psg, loop_psg, n_records, sq_loss


# --------------------------------------------------------------------------- dual graph
def test_train_eval_difference_gives_dual_graph() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64)
    model = Dual().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "fx-dual"
    assert "train/eval differ" in str(tengrad_fx.report(prepared))
    assert {layer.name for layer in covered_layers(prepared)} == {"body", "head", "aux"}
    # train mode: the tuple, and aux is captured
    prepared.train()
    orig.train()
    out, aux = prepared(x)
    o_ref, a_ref = orig(x)
    torch.testing.assert_close(out, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(aux, a_ref, rtol=0, atol=0)
    (out.sum() + aux.square().sum()).backward()
    assert {layer.name for layer in covered_layers(prepared) if get_info(prepared).store.records.get(
        layer.spec.sites[0])} == {"body", "head", "aux"}
    # eval mode: the tensor, and per-sample grads are exact
    prepared.eval()
    orig.eval()
    res = prepared(x)
    assert isinstance(res, torch.Tensor)
    torch.testing.assert_close(res, orig(x), rtol=0, atol=0)
    check_psg(prepared, orig, x, torch.randn(3, 3, dtype=torch.float64), layers=["body", "head"])


class Constants(nn.Module):
    """Tensors that are neither parameters nor buffers: a plain attribute, and constants
    created in forward (the tracer stores those on the root module), different per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.scale = torch.tensor([1.0, 2.0, 3.0, 4.0])  # plain attribute

    def forward(self, x):
        h = self.fc(x) * self.scale + torch.tensor([0.5, -0.5, 0.25, 0.0])
        if self.training:
            h = h * torch.tensor([2.0, 1.0, 1.0, 3.0])
        return self.out(torch.tanh(h))


def test_tensor_constants_survive_and_original_is_untouched() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = Constants()
    orig = copy.deepcopy(model)
    attrs = set(model.__dict__)
    keys = list(model.state_dict())
    prepared = prepare(model, example_inputs=(x[:2],))
    assert get_info(prepared).method == "fx-dual"
    assert set(model.__dict__) == attrs  # no tracer constants left on the original
    assert list(prepared.state_dict()) == keys
    assert {layer.name for layer in covered_layers(prepared)} == {"fc", "out"}
    for mode in (True, False):
        prepared.train(mode)
        orig.train(mode)
        torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    prepared.train()
    prepared(x).sum().backward()
    assert n_records(prepared) == 2


# --------------------------------------------------------------------------- untraceable
def test_untraceable_without_example_inputs_raises() -> None:
    with pytest.raises(RuntimeError, match="example_inputs"):
        prepare(Untraceable())


def test_untraceable_uses_module_surgery_and_is_exact() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 6, dtype=torch.float64)
    model = Untraceable().double()
    orig = copy.deepcopy(model)
    params = dict(model.named_parameters())
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "surgery"
    assert info.trace_error
    assert "module surgery" in str(tengrad_fx.report(prepared))
    assert all(p is params[k] for k, p in prepared.named_parameters())
    assert list(prepared.state_dict()) == list(orig.state_dict())
    assert {layer.name for layer in covered_layers(prepared)} == {"fc1", "fc2"}
    y = torch.randn(3, 3, dtype=torch.float64)
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    check_psg(prepared, orig, x, y, ref=loop_psg(orig, x, y))
    # capture off works there too
    get_info(prepared).store.clear()
    with capturing(prepared, False):
        sq_loss(prepared(x), y).backward()
    assert get_info(prepared).store.records == {}


class UntraceableFolded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        if x.abs().sum() > 0:
            x = x * 1.5
        h = self.fc(x.reshape(-1, x.shape[-1])).reshape(x.shape[0], x.shape[1], -1)
        return self.out(torch.tanh(h).mean(1))


def test_surgery_batch_folded_layer_is_covered_by_its_rows() -> None:
    """``fc`` sees ``[m·5, 4]``: the fold probe finds sample i's rows ``5i..5i+4`` (surgery too)."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    model = UntraceableFolded().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "surgery"
    assert not info.fallback, info.fallback
    assert [layer.name for layer in covered_layers(prepared)] == ["fc", "out"]
    y = torch.randn(3, 3, dtype=torch.float64)
    torch.testing.assert_close(prepared(x), orig(x), rtol=0, atol=0)
    check_psg(prepared, orig, x, y, ref=loop_psg(orig, x, y))


def test_surgery_tied_pair_is_fallback() -> None:
    class UntraceableTied(TiedPair):
        def forward(self, x):
            if x.abs().sum() > 0:
                x = -x
            return super().forward(x)

    x = torch.randn(3, 4, dtype=torch.float64)
    model = UntraceableTied().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    info = get_info(prepared)
    assert info.method == "surgery"
    assert "tied" in info.fallback["a.weight"]
    assert [layer.name for layer in covered_layers(prepared)] == ["out", "b.bias"]  # b.bias: replayed
    y = torch.randn(3, 2, dtype=torch.float64)
    check_psg(prepared, orig, x, y, ref=loop_psg(orig, x, y))


def test_surgery_keyword_call_is_captured() -> None:
    class UntraceableKwarg(KwargCall):
        def forward(self, x):
            if x.abs().sum() > 0:
                x = -x
            return super().forward(x)

    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    model = UntraceableKwarg().double()
    orig = copy.deepcopy(model)
    prepared = prepare(model, example_inputs=(x[:2],))
    assert get_info(prepared).method == "surgery"
    assert {layer.name for layer in covered_layers(prepared)} == {"fc", "out"}
    y = torch.randn(3, 2, dtype=torch.float64)
    check_psg(prepared, orig, x, y, ref=loop_psg(orig, x, y))
    assert len(get_info(prepared).store.records[covered_layers(prepared)[0].spec.sites[0]]) == 2


# --------------------------------------------------------------------------- torch.compile
def _compile_case(backend: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    prepared = prepare(MLP(), example_inputs=(x[:2],))
    sq_loss(prepared(x), y).backward()
    eager = [p.grad.clone() for p in prepared.parameters()]
    eager_psg = [layer.per_sample_grads()[0].clone() for layer in covered_layers(prepared)]
    prepared.zero_grad()
    get_info(prepared).store.clear()
    compiled = torch.compile(prepared, backend=backend)
    assert get_info(compiled) is get_info(prepared)
    sq_loss(compiled(x), y).backward()
    for p, g in zip(prepared.parameters(), eager):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    store = get_info(prepared).store
    assert store.records, "compiled model captured nothing"
    for layer, ref in zip(covered_layers(compiled), eager_psg):
        torch.testing.assert_close(layer.per_sample_grads()[0], ref, rtol=1e-5, atol=1e-6)
    # a second step releases and re-records
    gen = store.generation
    sq_loss(compiled(x), y).backward()
    assert store.generation == gen + 1 and n_records(prepared) == 2


def test_torch_compile_aot_eager_records() -> None:
    _compile_case("aot_eager")


@pytest.mark.slow
def test_torch_compile_inductor_records() -> None:
    t = time.time()
    _compile_case("inductor")
    print(f"inductor compile case: {time.time() - t:.1f}s")
