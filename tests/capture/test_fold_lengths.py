"""Folded batches at a length other than the probe's: ``[B·T, d]`` rows (each sample's rows
one block) and sequence-first ``(T, B, d)`` rows (one row per sample in each block) are
regrouped per sample at any ``T`` once the forward knows the batch size; per-sample
gradients and the TENGraD step are exact there (float64, against ``torch.func`` on the
ORIGINAL model). Layouts whose scaling factor one probe cannot tell keep a clear error."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.capture.folded_rows import FOLDS, fold_rows, layout_at, unfold_rows
from testing import check_covered_layers, check_tengrad_step, dense_layer_updates, per_sample_grads_reference

TOL = 1e-10


class RowFolded(nn.Module):
    """``x [B, T, 3]`` -> Linear, LayerNorm, Linear on ``x.reshape(-1, d)`` (``[B·T, d]``,
    ``order="rows"``) or on ``x.transpose(0, 1)`` (``(T, B, d)``, ``order="seq_first"``),
    mean over the positions -> ``[B, 3]`` logits."""

    def __init__(self, order: str):
        super().__init__()
        self.order = order
        self.stem = nn.Linear(3, 4)
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = torch.tanh(self.stem(x))
        h = h.reshape(-1, 4) if self.order == "rows" else h.transpose(0, 1)
        h = self.out(self.norm(torch.tanh(self.fc(h))))
        h = h.reshape(B, T, 4) if self.order == "rows" else h.transpose(0, 1)
        return self.head(h.mean(1))


def _setup(order: str, seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    net = RowFolded(order).double()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return net, copy.deepcopy(net)


@pytest.mark.parametrize("order,probed", [("rows", (1, 4)), ("seq_first", (4, 1))])
def test_other_lengths_are_exact(order: str, probed: tuple[int, int]) -> None:
    net, orig = _setup(order)
    prepared = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 4, 3, dtype=torch.float64),))
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback, info.fallback
    key = info.store.key
    assert {s.name: FOLDS.get((key, s.sites[0])) for s in info.layers} == {
        "stem": None, "head": None, "fc": probed, "norm": probed, "out": probed}
    gen = torch.Generator().manual_seed(3)
    for T in (5, 7, 1):
        x = torch.randn(3, T, 3, dtype=torch.float64, generator=gen)
        y = torch.randint(0, 3, (3,), generator=gen)
        prepared.zero_grad(set_to_none=True)
        check_covered_layers(orig, prepared, x, y, tol=TOL)  # (per-sample grads [3, ...])


@pytest.mark.parametrize("order", ["rows", "seq_first"])
def test_tengrad_step_at_other_length_is_exact(order: str) -> None:
    net, orig = _setup(order, seed=1)
    model = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 4, 3, dtype=torch.float64),))
    opt = TENGraD(model, lr=1.0, damping=0.05, momentum=0.0, curvature_every=1, kl_clip=None)
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(5, 6, 3, dtype=torch.float64, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    check_tengrad_step(model, opt, orig, x, y, 0.05)


def test_frozen_weight_trainable_bias_at_other_length_is_exact() -> None:
    """A bias-only layer on ``[B·T, d]`` rows: per-sample sums over the sample's rows."""
    net, orig = _setup("rows", seed=2)
    net.fc.weight.requires_grad_(False)
    prepared = tengrad_fx.prepare(net, example_inputs=(torch.randn(2, 4, 3, dtype=torch.float64),))
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(3, 6, 3, dtype=torch.float64, generator=gen), torch.randint(0, 3, (3,), generator=gen)
    F.cross_entropy(prepared(x), y).backward()
    ref = per_sample_grads_reference(orig, x, F.cross_entropy, y)
    (fc,) = [layer for layer in tengrad_fx.covered_layers(prepared) if layer.name == "fc"]
    assert fc.bias_only
    db = fc.jacobian()  # [m, n]: the bias's per-sample gradients
    assert db.shape == (3, 6)
    assert ((db - ref["fc.bias"]).norm() / ref["fc.bias"].norm()).item() <= TOL


class Blocks(nn.Module):
    """``x [B, T, 3]`` with ``T = 2·S`` folded to ``[2·B·S, 4]`` rows ``[2, m, S]``: both
    factors above 1, so the probe at ``T = 4`` cannot tell which one follows the length."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(3, 4)
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        h = self.stem(x).reshape(B, 2, T // 2, 4).transpose(0, 1).reshape(-1, 4)
        h = self.fc(h).reshape(2, B, T // 2, 4).transpose(0, 1)
        return self.head(h.mean((1, 2)))


def test_layout_with_two_factors_keeps_its_length_and_says_why() -> None:
    torch.manual_seed(0)
    prepared = tengrad_fx.prepare(Blocks(), example_inputs=(torch.randn(2, 4, 3),))
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback, info.fallback
    (fc,) = [spec for spec in info.layers if spec.name == "fc"]
    assert FOLDS[(info.store.key, fc.sites[0])] == (2, 2)
    F.cross_entropy(prepared(torch.randn(5, 4, 3)), torch.randint(0, 3, (5,))).backward()  # the probed length
    with pytest.raises(RuntimeError, match="layer 'fc'.*probed as \\[2, m, 2\\].*6 rows per sample at batch 5"
                                           ".*both above 1"):
        prepared(torch.randn(5, 6, 3))


def test_layout_at() -> None:
    assert layout_at((1, 4), 4) == (1, 4) and layout_at((1, 4), 9) == (1, 9)
    assert layout_at((4, 1), 7) == (7, 1) and layout_at((3, 5), 15) == (3, 5)
    assert layout_at((3, 5), 20) is None and layout_at((1, 1), 2) is None and layout_at((1, 4), 0) is None


def test_fold_rows_regroups_per_sample_and_back() -> None:
    m, T = 3, 5
    seq_first = torch.arange(T * m * 2, dtype=torch.float64).reshape(T, m, 2)  # row t·m + i: sample i
    rows = fold_rows(seq_first, (4, 1), 1, "l", m=m)  # probed at length 4
    assert torch.equal(rows, seq_first.transpose(0, 1))
    assert torch.equal(unfold_rows(rows, (4, 1), (T, m)), seq_first)
    flat = torch.arange(m * T * 2, dtype=torch.float64).reshape(m * T, 2)  # row i·T + t: sample i
    rows = fold_rows(flat, (1, 4), 1, "l", m=m)
    assert torch.equal(rows, flat.reshape(m, T, 2))
    assert torch.equal(unfold_rows(rows, (1, 4), (m * T,)), flat)


def test_rows_that_cannot_be_mapped_keep_a_clear_error() -> None:
    x = torch.zeros(14, 2)
    with pytest.raises(RuntimeError, match="layer 'l'.*14 rows, not a multiple of the batch size 3"):
        fold_rows(x, (1, 4), 1, "l", m=3)
    with pytest.raises(RuntimeError, match="layer 'l'.*7 rows per sample at batch 2.*both above 1"):
        fold_rows(x, (2, 2), 1, "l", m=2)
    with pytest.raises(RuntimeError, match="layer 'l'.*14 rows. Prepare"):
        fold_rows(x, (1, 4), 1, "l")  # batch size unknown: only the probed rows per sample


def _tiny_opt() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=32, hidden_size=8, num_hidden_layers=1, ffn_dim=16, num_attention_heads=2,
            max_position_embeddings=16, word_embed_proj_dim=8, bos_token_id=0, eos_token_id=0,
            pad_token_id=0)).double().eval()


def _last_logits_loss(out, y):  # type: ignore[no-untyped-def]
    return F.cross_entropy(out.logits[:, -1], y)


def test_opt_probed_at_one_length_is_exact_at_others() -> None:
    """OPT's MLP and final LayerNorm see ``[B·T, d]``: probed at T = 4, exact at T = 5 and 7."""
    torch.manual_seed(0)
    model = _tiny_opt()
    orig = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    prepared = tengrad_fx.prepare(model, example_inputs={"input_ids": torch.randint(1, 32, (2, 4), generator=gen)})
    info = tengrad_fx.get_info(prepared)
    assert not info.fallback, info.fallback
    assert sum(k[0] == info.store.key for k in FOLDS) >= 3  # fc1, fc2, final_layer_norm
    for T in (5, 7):
        ids, y = torch.randint(1, 32, (3, T), generator=gen), torch.randint(0, 32, (3,), generator=gen)
        prepared.zero_grad(set_to_none=True)  # (a new batch, not another micro-batch)
        _last_logits_loss(prepared(input_ids=ids), y).backward()
        ref = per_sample_grads_reference(orig, ids, _last_logits_loss, y)
        names = {id(p): n for n, p in prepared.named_parameters()}
        for layer in tengrad_fx.covered_layers(prepared):
            dW, db = layer.per_sample_grads()
            pairs = [(dW, layer.weight)] + ([(db, layer.bias)] if layer.bias is not None else [])
            for ours, p in pairs:  # (k_proj's bias gradient is zero: softmax ignores it)
                want = ref[names[id(p)]]
                err = ((ours - want).norm() / want.norm().clamp_min(1e-6)).item()
                assert ours.shape == want.shape and err <= 1e-9, (names[id(p)], T, err)


@pytest.mark.parametrize("T", [5, 7])
def test_opt_tengrad_step_at_another_length_is_exact(T: int) -> None:
    torch.manual_seed(2)
    model = _tiny_opt()
    orig = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    prepared = tengrad_fx.prepare(model, example_inputs={"input_ids": torch.randint(1, 32, (2, 4), generator=gen)})
    damping = 0.05
    opt = TENGraD(prepared, lr=1.0, damping=damping, momentum=0.0, curvature_every=1, kl_clip=None)
    ids, y = torch.randint(1, 32, (4, T), generator=gen), torch.randint(0, 32, (4,), generator=gen)
    _last_logits_loss(prepared(input_ids=ids), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in prepared.named_parameters() if p.grad is not None}
    before = {n: p.detach().clone() for n, p in prepared.named_parameters()}
    opt.step()
    ref = dense_layer_updates(orig, ids, y, _last_logits_loss, grads, damping, tengrad_fx.get_info(prepared).covered)
    assert set(ref) == set(grads), set(grads) ^ set(ref)
    after = dict(prepared.named_parameters())
    blocks: dict[str, list[str]] = {}
    for n, layer in tengrad_fx.get_info(prepared).covered.items():
        blocks.setdefault(layer, []).append(n)
    assert sum(map(len, blocks.values())) == len(ref)
    for layer, pns in blocks.items():  # per block: k_proj's bias alone moves by rounding only
        d = torch.cat([(before[n] - after[n].detach()).flatten() for n in pns])
        want = torch.cat([ref[n].flatten() for n in pns])
        err = ((d - want).norm() / want.norm()).item()
        assert err <= 1e-8, (layer, err)
