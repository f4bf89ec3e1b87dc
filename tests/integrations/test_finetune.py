"""Fine-tuning setups, float64, against ``torch.func`` per-sample gradients and dense block NGD.

* BitFit (only biases trainable): each covered layer with a frozen weight and a trainable
  bias is a bias-only layer, ``J = [Σ_s G_i[s]]_i``, recorded without the layer's input.
* LoRA with ``peft``: the ``lora_A``/``lora_B`` Linears over a frozen base, on a tiny BERT
  (the ``SEQ_CLS`` classifier a trainable ``modules_to_save`` copy) and a tiny Llama;
  ``lora_dropout > 0`` in train mode records the dropped input.
* A frozen backbone records nothing and adds no op to the optimizer's step.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.capture import eager
from tengrad_fx.utils.dispatch import OpCounter
from testing.oracle import check_covered_layers, check_tengrad_step

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

DAMPING = 0.1


@pytest.fixture(autouse=True)
def _one_thread():  # type: ignore[no-untyped-def]
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Logits(nn.Module):
    """A Hugging Face model called on token ids, returning ``[m, classes]`` logits (a causal
    LM: those of the last position)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids).logits
        return out if out.dim() == 2 else out[:, -1]


def tiny_bert() -> nn.Module:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=37, max_position_embeddings=16, num_labels=3,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg).double().eval()


def tiny_llama() -> nn.Module:
    """Llama with ``nn.RMSNorm`` in place of ``LlamaRMSNorm`` (same maths, which computes in
    float32 whatever the dtype: the float64 reference would carry float32 roundoff)."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, intermediate_size=37, max_position_embeddings=16)
    net = transformers.LlamaForCausalLM(cfg).double().eval()
    for name, mod in list(net.named_modules()):
        if type(mod).__name__ == "LlamaRMSNorm":
            rms = nn.RMSNorm(mod.weight.shape[0], eps=mod.variance_epsilon, dtype=torch.float64)
            rms.weight.data.copy_(mod.weight.data)
            net.set_submodule(name, rms)
    return net


def lora(base: nn.Module, targets: list[str], **kw: object) -> nn.Module:
    """``peft`` LoRA r=4 on ``targets``, ``lora_B`` drawn at random (peft's zeros would make
    ``lora_A``'s gradients vanish)."""
    net = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=targets, **kw)).double()
    for n, p in net.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p.data)
    return net


def check_exact(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """Prepare ``net``; assert every trainable parameter covered, the per-sample gradients,
    Grams, ``J v``, ``Jᵀc`` of every covered layer equal ``torch.func``'s, and one TENGraD
    step equal dense block NGD ``(F + αI)⁻¹ g``. Returns the prepared model."""
    orig = copy.deepcopy(net)
    prep = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    rep = tengrad_fx.report(prep)
    assert rep.n_fallback == 0 and rep.n_covered == sum(p.requires_grad for p in prep.parameters()), str(rep)
    check_covered_layers(orig, prep, x, y, tol=1e-9)
    prep.zero_grad()
    opt = tengrad_fx.TENGraD(prep, lr=1.0, damping=DAMPING, momentum=0.0, curvature_every=1, kl_clip=None)
    check_tengrad_step(prep, opt, orig, x, y, DAMPING, tol=1e-9)
    return prep


def bitfit(net: nn.Module, keep: str = "") -> nn.Module:
    """Only the biases trainable (and parameters whose name contains ``keep``, if given)."""
    for n, p in net.named_parameters():
        p.requires_grad_(n.endswith("bias") or bool(keep and keep in n))
    return net


class ConvMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 4 * 4, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = nn.RMSNorm(8)  # no bias: frozen whole
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().flatten(1)
        return self.fc2(self.rms(self.ln(self.fc1(h)).tanh()))


# --------------------------------------------------------------------------- BitFit
@pytest.mark.parametrize("custom_ops", [False, True])
@pytest.mark.parametrize("keep", ["", "fc2.weight"])
def test_bitfit_conv_mlp(monkeypatch: pytest.MonkeyPatch, custom_ops: bool, keep: str) -> None:
    monkeypatch.setattr(eager, "FORCE_CUSTOM_OPS", custom_ops)
    torch.manual_seed(0)
    net = bitfit(ConvMLP().double().eval(), keep)
    x, y = torch.randn(6, 2, 6, 6, dtype=torch.float64), torch.randint(0, 3, (6,))
    prep = check_exact(net, x, y)
    rows = {p: d for p, s, d in tengrad_fx.report(prep).rows if s == "covered"}
    assert "bias-only conv2d 'conv'" in rows["conv.bias"] and "bias-only layernorm 'ln'" in rows["ln.bias"]
    layers = {lay.name: lay for lay in tengrad_fx.covered_layers(prep)}
    assert set(layers) == {"conv", "bn", "fc1", "ln", "fc2"}  # the RMSNorm: nothing trainable
    for name, lay in layers.items():
        assert lay.bias_only == (name != "fc2" or not keep)
        if lay.bias_only:  # J from the per-sample bias sums alone: no input recorded
            assert lay.params == [prep.get_submodule(name).bias]
            assert all(r.I is None and r.G is None and r.P.shape == (6, lay.weight.numel()) for r in lay.records())


def test_bitfit_bert() -> None:
    torch.manual_seed(0)
    # every bias but the attention keys': softmax is invariant to the key bias, whose gradient
    # is zero (a relative comparison of two roundoffs would say nothing)
    net = Logits(tiny_bert())
    for n, p in net.named_parameters():
        p.requires_grad_(n.endswith("bias") and ".key." not in n)
    x, y = torch.randint(0, 64, (5, 7)), torch.randint(0, 3, (5,))
    prep = check_exact(net, x, y)
    layers = tengrad_fx.covered_layers(prep)
    assert len(layers) == 17 and all(lay.bias_only for lay in layers)
    assert {lay.kind for lay in layers} == {"linear", "layernorm"}


# --------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_lora_exact(arch: str) -> None:
    torch.manual_seed(0)
    if arch == "bert":  # SEQ_CLS: the classifier is a trainable modules_to_save copy
        net, n_out = lora(tiny_bert(), ["query", "value"], task_type="SEQ_CLS"), 3
    else:
        net, n_out = lora(tiny_llama(), ["q_proj", "v_proj"]), 64
    x, y = torch.randint(0, 64, (5, 7)), torch.randint(0, n_out, (5,))
    prep = check_exact(Logits(net), x, y)
    names = [lay.name for lay in tengrad_fx.covered_layers(prep)]
    assert sum("lora_A" in n for n in names) == sum("lora_B" in n for n in names) == 4
    if arch == "bert":
        assert any(n.endswith("classifier.modules_to_save.default") for n in names)
        assert len(names) == 9


def test_lora_dropout_records_the_dropped_input() -> None:
    """Train mode, ``lora_dropout=0.5``: per-sample gradients equal autograd's of each
    sample's loss in the same forward (the same dropout masks, by the same seed)."""
    torch.manual_seed(0)
    net = Logits(lora(tiny_bert(), ["query", "value"], lora_dropout=0.5)).train()
    orig = copy.deepcopy(net)
    x, y = torch.randint(0, 64, (5, 7)), torch.randint(0, 3, (5,))
    prep = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    torch.manual_seed(1)
    F.cross_entropy(prep(x), y).backward()
    torch.manual_seed(1)
    losses = F.cross_entropy(orig(x), y, reduction="none")
    params = dict(orig.named_parameters())
    names = {id(p): n for n, p in prep.named_parameters()}
    layers = [lay for lay in tengrad_fx.covered_layers(prep) if "lora" in lay.name]
    wanted = [params[names[id(lay.weight)]] for lay in layers]
    per_sample = [torch.autograd.grad(loss, wanted, retain_graph=True) for loss in losses]
    for j, lay in enumerate(layers):
        ref = torch.stack([g[j] for g in per_sample])
        torch.testing.assert_close(lay.per_sample_grads()[0], ref, rtol=1e-10, atol=1e-14)
        if "lora_A" in lay.name:  # its input is the dropout's output: about half zeros
            (rec,) = lay.records()
            assert 0.3 < (rec.I == 0).double().mean().item() < 0.7


# --------------------------------------------------------------------------- frozen backbone
def frozen_backbone(depth: int) -> nn.Module:
    """A trainable first and last Linear around ``depth`` frozen blocks (Linear, LayerNorm, tanh)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Tanh()).requires_grad_(False)
              for _ in range(depth)]
    return nn.Sequential(nn.Linear(6, 16), *blocks, nn.Linear(16, 3)).double()


def test_frozen_backbone_costs_nothing_in_the_step() -> None:
    """Frozen layers are neither recorded nor in the Gram/solve: the store holds the
    trainable layers' records only, and a curvature step dispatches the same aten ops as on
    the model with the frozen blocks removed."""
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    counts, records = [], []
    for depth in (4, 0):
        net = tengrad_fx.prepare(frozen_backbone(depth), example_inputs=(x[:2],))
        opt = tengrad_fx.TENGraD(net, lr=0.1, damping=DAMPING, curvature_every=1)
        for _ in range(2):  # the second step counted (momentum buffers exist)
            opt.zero_grad()
            F.cross_entropy(net(x), y).backward()
            with OpCounter() as oc:
                opt.step()
        store = tengrad_fx.get_info(net).store
        layers = tengrad_fx.covered_layers(net)
        assert [lay.name for lay in layers] == ["0", str(depth + 1)]
        assert set(store.records) == {s for lay in layers for s in lay.spec.sites}
        counts.append(oc.ops)
        records.append(sorted(tuple(r.in_shape) for recs in store.records.values() for r in recs))
    assert records[0] == records[1]
    assert counts[0] == counts[1]
