"""``tengrad_fx.unprepare``: the model given to ``prepare`` back, for deployment.

On an MLP, a CNN with BatchNorm, torchvision's ResNet-18, a transformer block
(``nn.MultiheadAttention``, LayerNorm, an embedding tied to the head), a model prepared
by module surgery (with an added parameter on its root) and a tiny Hugging Face GPT-2:
the unprepared model holds the same Parameter and buffer objects, computes what the
prepared model computes with capture on and off, keeps no trace of ``tengrad_fx`` (its
classes, attributes, pickle), and goes through ``torch.jit.trace`` and ``torch.export``;
its exported program, and that of the prepared model with capture off, hold aten ops
only and run in a process that never imports ``tengrad_fx``.
"""
from __future__ import annotations

import copy
import operator
import os
import pickle
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import get_info
from testing.all_kinds import AllKinds, inputs

Case = tuple[Callable[[], nn.Module], Callable[[int, int], tuple[torch.Tensor, ...]]]


class Block(nn.Module):
    """Token embedding tied to the output head, pre-norm self-attention and MLP;
    ``idx [m, T]`` -> logits ``[m, T, V]``."""

    def __init__(self, vocab: int = 11, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        return self.head(h + self.mlp(self.ln2(h)))


class Branchy(nn.Module):
    """A forward that branches on its input's rank (torch.fx cannot trace it: module
    surgery; torch.export can) and adds a ``[1, d]`` parameter of the root;
    ``x [m, 6]`` -> ``[m, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 7)
        self.ln = nn.LayerNorm(7)
        self.pos = nn.Parameter(torch.randn(1, 7) * 0.1)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            x = x.flatten(1)
        return self.fc2(torch.tanh(self.ln(self.fc1(x)) + self.pos))


class Leaf(nn.Module):
    """A forward torch.fx cannot trace, kept as a leaf of the fx graph (timm's notrace
    registry, as timm's attention modules): its Linear is covered by surgery on the fx
    path; ``x [m, 4, 4]`` -> ``[m, 4, 4]``."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = int(x.shape[1])
        return torch.softmax(self.q(x) @ x.transpose(1, 2) / n, -1) @ x


def _with_leaf() -> nn.Module:
    from timm.layers import _fx as timm_fx

    timm_fx.register_notrace_module(Leaf)
    return nn.Sequential(nn.Linear(4, 4), Leaf(), nn.Flatten(), nn.Linear(16, 3)).double()


def _randn(*shape: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    def make(m: int, seed: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(m, *shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64),)
    return make


def _tokens(m: int, seed: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 11, (m, 5), generator=torch.Generator().manual_seed(seed)),)


def _resnet18() -> nn.Module:
    import torchvision
    return torchvision.models.resnet18(num_classes=4).double()


CASES: dict[str, Case] = {
    "mlp": (lambda: nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 3)).double(), _randn(5)),
    "cnn": (lambda: nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2), nn.BatchNorm2d(4),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).double(), _randn(3, 8, 8)),
    "block": (lambda: Block().double(), _tokens),
    "leaf": (_with_leaf, _randn(4, 4)),
    "allkinds": (lambda: AllKinds().double(), lambda m, seed: (inputs(m, seed)[0].double(), inputs(m, seed)[1])),
    "surgery": (lambda: Branchy().double(), _randn(6)),
}
SHAPES = {"resnet18": (3, 16, 16), "scaled": (5,)}  # the inputs of the models built outside CASES
METHOD = {"mlp": "fx", "cnn": "fx", "block": "fx", "leaf": "fx", "allkinds": "fx", "surgery": "surgery"}


def _close(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Equal to rounding: 1e-12 in float64, 1e-6 in float32."""
    tol = 1e-12 if b.dtype == torch.float64 else 1e-6
    torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=msg or None)


def _prepared(name: str, build: Callable[[], nn.Module] | None = None,
              ) -> tuple[nn.Module, nn.Module, list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """``(model, prepared, [its parameters and buffers], fresh inputs [4, ...])``."""
    build, make = (build, _randn(*SHAPES[name])) if build is not None else CASES[name]
    torch.manual_seed(0)
    model = build()
    tensors = [*model.parameters(), *model.buffers()]
    prepared = tengrad_fx.prepare(model, example_inputs=make(2, 1))
    assert get_info(prepared).method == METHOD.get(name, "fx")
    assert get_info(prepared).layers
    if name == "leaf":
        assert get_info(prepared).covered["1.q.weight"] == "1.q"  # by surgery inside the fx leaf
    return model, prepared, tensors, make(4, 2)


def _outputs(model: nn.Module, xs: tuple[torch.Tensor, ...], capture: bool | None = None) -> torch.Tensor:
    if capture is None:
        return model(*xs).detach()
    with tengrad_fx.capturing(model, capture):
        return model(*xs).detach()


def _no_tengrad_fx_left(model: nn.Module) -> None:
    """No module of ``model`` has a class or attribute of tengrad_fx's, and its pickle
    names nothing of tengrad_fx."""
    for name, mod in model.named_modules():
        for cls in type(mod).__mro__:
            assert not cls.__module__.startswith("tengrad_fx"), (name, cls)
            assert not [k for k in cls.__dict__ if "tengrad" in k], (name, cls)
        assert not [k for k in mod.__dict__ if "tengrad" in k], (name, mod.__dict__.keys())
    assert b"tengrad_fx" not in pickle.dumps(model)


def _aten_only(ep: torch.export.ExportedProgram) -> None:
    for node in ep.graph.nodes:
        if node.op == "call_function":
            t = node.target
            assert t is operator.getitem or (isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"), t


@dataclass
class Deployed:
    """One case prepared, run, exported and unprepared (:func:`_deploy`)."""

    model: nn.Module  # the module given to prepare
    tensors: list[torch.Tensor]  # its parameters and buffers before prepare
    keys: list[str]  # the prepared model's state_dict keys
    xs: tuple[torch.Tensor, ...]
    y: dict[tuple[bool, bool], torch.Tensor]  # (train, capture) -> the prepared model's output
    plain: nn.Module  # unprepare's result, in eval mode
    y_plain_train: torch.Tensor  # its output in train mode (on a deep copy)
    exported: dict[str, torch.export.ExportedProgram]  # capture_off, unprepared (eval mode)
    exported_train: torch.export.ExportedProgram  # capture off, train mode (not run)
    exported_no_grad: torch.export.ExportedProgram  # capture on under torch.no_grad(), eval mode
    error_again: str  # unprepare's error when called again


def _deploy(name: str, out_dir: Path) -> Deployed:
    """Prepare case ``name``; its outputs in train and eval mode with capture on and off
    (eval last: the train-mode forwards update BatchNorm's statistics); export it with
    capture off, in eval mode (and in train mode, and with capture on under
    ``torch.no_grad()``); unprepare and export that (eval mode);
    save the eval-mode programs with their inputs and outputs under ``out_dir``."""
    model, prepared, tensors, xs = _prepared(name)
    y = {}
    for train in (True, False):
        prepared.train(train)
        for on in (True, False):
            y[train, on] = _outputs(prepared, xs, on)
    with tengrad_fx.capturing(prepared, False):
        exported = {"capture_off": torch.export.export(prepared, xs)}
        exported_train = torch.export.export(prepared.train(), xs)
    with torch.no_grad():
        exported_no_grad = torch.export.export(prepared.eval(), xs)
    keys = list(prepared.state_dict())
    plain = tengrad_fx.unprepare(prepared)
    exported["unprepared"] = torch.export.export(plain, xs)
    for tag, ep in exported.items():
        torch.export.save(ep, str(out_dir / f"{name}-{tag}.pt2"))
        torch.save((xs, y[False, True]), out_dir / f"{name}-{tag}.io")
    with pytest.raises(ValueError, match="not prepared") as again:
        tengrad_fx.unprepare(plain if name == "surgery" else prepared)
    return Deployed(model, tensors, keys, xs, y, plain, _outputs(copy.deepcopy(plain).train(), xs), exported,
                    exported_train, exported_no_grad, str(again.value))


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Deployed], Path]:
    out_dir = tmp_path_factory.mktemp("deployed")
    return {name: _deploy(name, out_dir) for name in CASES}, out_dir


@pytest.mark.parametrize("name", list(CASES))
def test_same_objects_same_outputs(deployed: tuple[dict[str, Deployed], Path], name: str) -> None:
    d = deployed[0][name]
    assert d.plain is d.model and not d.plain.training
    got = [*d.plain.parameters(), *d.plain.buffers()]
    assert len(got) == len(d.tensors) and all(a is b for a, b in zip(got, d.tensors))
    assert list(d.plain.state_dict()) == d.keys
    for train in (True, False):
        _close(d.y[train, False], d.y[train, True])
    _close(_outputs(d.plain, d.xs), d.y[False, True])
    _close(d.y_plain_train, d.y[True, True])
    assert "not prepared" in d.error_again


@pytest.mark.parametrize("name", list(CASES))
def test_nothing_of_tengrad_fx_left(deployed: tuple[dict[str, Deployed], Path], name: str) -> None:
    d = deployed[0][name]
    _no_tengrad_fx_left(d.plain)
    assert torch.equal(_outputs(copy.deepcopy(d.plain), d.xs), _outputs(d.plain, d.xs))


@pytest.mark.parametrize("name", list(CASES))
def test_jit_trace(deployed: tuple[dict[str, Deployed], Path], name: str) -> None:
    """With torch.jit.trace's check (which a prepared model fails); the block unchecked
    (nn.MultiheadAttention fails that check before prepare too)."""
    d = deployed[0][name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(d.plain, d.xs, check_trace=name != "block")
        scripted = torch.jit.script(d.plain) if name in ("mlp", "cnn") else None  # (nn.Sequential scripts)
    assert torch.equal(traced(*d.xs).detach(), _outputs(d.plain, d.xs))
    if scripted is not None:
        assert torch.equal(scripted(*d.xs).detach(), _outputs(d.plain, d.xs))


@pytest.mark.parametrize("name", list(CASES))
def test_exported_programs_are_aten_only(deployed: tuple[dict[str, Deployed], Path], name: str) -> None:
    d = deployed[0][name]
    _aten_only(d.exported_train)
    _aten_only(d.exported_no_grad)
    _close(d.exported_no_grad.module()(*d.xs), d.y[False, True])
    for tag, ep in d.exported.items():
        _aten_only(ep)
        _close(ep.module()(*d.xs), d.y[False, True], tag)


_LOAD = """
import sys, torch
from pathlib import Path
for f in sorted(Path(sys.argv[1]).glob('*.pt2')):
    ep = torch.export.load(str(f))
    xs, y = torch.load(str(f.with_suffix('.io')))
    torch.testing.assert_close(ep.module()(*xs), y, rtol=1e-12, atol=1e-12)
    print(f.stem)
assert 'tengrad_fx' not in sys.modules, 'tengrad_fx was imported'
"""


def test_exported_programs_run_without_tengrad_fx(deployed: tuple[dict[str, Deployed], Path]) -> None:
    """Saved, the programs of every case load and compute the prepared model's outputs in
    a fresh process that never imports tengrad_fx."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", _LOAD, str(deployed[1])], cwd=deployed[1], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == sorted(f"{name}-{tag}" for name in CASES for tag in ("capture_off", "unprepared"))


def test_resnet18() -> None:
    """torchvision's ResNet-18 (float64): the same objects and outputs; both exported
    programs hold aten ops only and compute the outputs."""
    model, prepared, tensors, xs = _prepared("resnet18", _resnet18)
    y = _outputs(prepared.eval(), xs, True)
    with tengrad_fx.capturing(prepared, False):
        eps = [torch.export.export(prepared, xs)]
    plain = tengrad_fx.unprepare(prepared)
    assert plain is model and all(a is b for a, b in zip([*plain.parameters(), *plain.buffers()], tensors))
    _close(_outputs(plain, xs), y)
    eps.append(torch.export.export(plain, xs))
    for ep in eps:
        _aten_only(ep)
        _close(ep.module()(*xs), y)


@pytest.mark.parametrize("name", ["cnn", "block", "surgery"])
def test_trained_weights_kept(name: str) -> None:
    """TENGraD steps after prepare move the weights; unprepare keeps them (the same
    objects) and the unprepared model computes what the trained prepared model does."""
    _, prepared, tensors, xs = _prepared(name)
    before = [t.detach().clone() for t in tensors]
    opt = tengrad_fx.TENGraD(prepared, lr=0.05, damping=0.1, curvature_every=1)
    for step in range(3):
        ins = CASES[name][1](4, 100 + step)
        out = prepared(*ins)
        loss = out.square().mean() if name != "block" else F.cross_entropy(out.flatten(0, 1), ins[0].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    prepared.eval()
    y = _outputs(prepared, xs, False)
    trained = [t.detach().clone() for t in tensors]
    plain = tengrad_fx.unprepare(prepared)
    got = [*plain.parameters(), *plain.buffers()]
    assert len(got) == len(tensors) and all(a is b for a, b in zip(got, tensors))
    assert all(torch.equal(a, b) for a, b in zip(got, trained))
    assert any(not torch.equal(a, b) for a, b in zip(trained, before))
    assert torch.equal(_outputs(plain, xs), y)


def test_prepare_again_after_unprepare() -> None:
    """The unprepared model prepares again and records."""
    _, prepared, _, xs = _prepared("surgery")
    plain = tengrad_fx.unprepare(prepared)
    again = tengrad_fx.prepare(plain, example_inputs=CASES["surgery"][1](2, 1))
    again(*xs).sum().backward()
    assert any(get_info(again).store.records.values())


class Scaled(nn.Module):
    """A Linear whose output is scaled by a buffer of the root; ``x [m, 5]`` -> ``[m, 3]``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_root_state_after_to_and_replaced_child() -> None:
    """FX path: the original module takes the prepared module's current root entries (a
    root buffer that ``.to()`` replaced, a child replaced after prepare) and its
    train/eval flag."""
    model, prepared, _, xs = _prepared("scaled", lambda: Scaled().double())
    assert get_info(prepared).method == "fx"
    prepared.to(torch.float32)
    new_fc = nn.Linear(5, 3)
    prepared._modules["fc"] = new_fc
    prepared.train(False)
    xs = tuple(x.float() for x in xs)
    y = _outputs(prepared, xs, False)
    plain = tengrad_fx.unprepare(prepared)
    assert plain is model and plain.fc is new_fc and not plain.training
    assert plain.scale is prepared.scale and plain.scale.dtype == torch.float32
    assert torch.equal(_outputs(plain, xs), y)


def test_wrapped_and_compiled_models() -> None:
    """A wrapper of the prepared module is refused with what to pass; a torch.compile
    wrapper is unwrapped."""
    _, prepared, _, _ = _prepared("mlp")
    with pytest.raises(ValueError, match="model.module"):
        tengrad_fx.unprepare(Wrapper(prepared))
    with pytest.raises(ValueError, match="not prepared"):
        tengrad_fx.unprepare(nn.Linear(2, 2))
    compiled = torch.compile(prepared)  # not run: only its _orig_mod is read
    assert type(tengrad_fx.unprepare(compiled)) is nn.Sequential


def test_root_layer() -> None:
    """A root that is itself a covered layer: the layer back, exported to aten."""
    layer = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    prepared = tengrad_fx.prepare(layer, example_inputs=(x[:2],))
    y = _outputs(prepared, (x,), True)
    plain = tengrad_fx.unprepare(prepared)
    assert plain is layer and type(plain) is nn.Linear
    _no_tengrad_fx_left(plain)
    ep = torch.export.export(plain, (x,))
    _aten_only(ep)
    _close(ep.module()(x), y)


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def _tiny_lm(family: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "gpt2":
            return transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=32, n_embd=8, n_layer=1, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0)).eval()
        # OPT: learned positions through an Embedding subclass that adds an offset (a routed lookup)
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=32, hidden_size=8, num_hidden_layers=1, ffn_dim=16, num_attention_heads=2,
            max_position_embeddings=16, word_embed_proj_dim=8, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)).eval()


@pytest.mark.parametrize("family", ["gpt2", "opt"])
def test_hf_lm_forward_and_generate(family: str) -> None:
    torch.manual_seed(0)
    model = _tiny_lm(family)
    cls, params = type(model), list(model.parameters())
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 32, (2, 5), generator=g)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def generate(m: nn.Module) -> Any:
        return m.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)

    expected = generate(model)
    # OPT folds the batch to [B·T, d] in its MLP (probed at the full length here)
    probe = ids if family == "opt" else ids[:, :4]
    prepared = tengrad_fx.prepare(model, example_inputs={"input_ids": probe})
    y = {on: _outputs_kw(prepared, inputs, on) for on in (True, False)}
    torch.testing.assert_close(y[True], y[False], rtol=1e-6, atol=1e-6)
    plain = tengrad_fx.unprepare(prepared)
    assert type(plain) is cls and all(a is b for a, b in zip(plain.parameters(), params))
    _no_tengrad_fx_left(plain)
    torch.testing.assert_close(plain(**inputs).logits.detach(), y[True], rtol=1e-6, atol=1e-6)
    assert torch.equal(generate(plain), expected)


def _outputs_kw(model: nn.Module, inputs: dict[str, torch.Tensor], capture: bool) -> torch.Tensor:
    with tengrad_fx.capturing(model, capture):
        return model(**inputs).logits.detach()
