"""Padded language-model batches, float64: the MC Fisher and the drawn position rows take
the positions the loss scores with no call of the user's, in a plain loop, under the
Hugging Face ``Trainer`` (a padding collator) and under Lightning.

Hugging Face's convention: ``labels`` −100 at padding, ``attention_mask`` 0 there, and a
causal LM's loss shifted by one (position ``t`` is scored where ``labels[t + 1] != −100``;
the last position never). The reference step of each test is the documented explicit
one, ``opt.mc_capture(logits, mask=scored)`` with ``scored`` built here from the labels;
the same draw of the seeded label generator is taken on both paths.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import tengrad_fx
from tengrad_fx.capture.scored import scored_positions
from tengrad_fx.optim.tengrad import position_rows
from tengrad_fx.utils.dispatch import SyncCounter
from tests.integrations._hf import V, build

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")

B, L, TOL, SEED = 6, 12, 1e-10, 3
FAMILIES = ["gpt2", "llama"]
NO_DROPOUT = {"gpt2": dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "llama": {}}


def _rows(n: int, seed: int, lengths: tuple[int, int] = (4, L)) -> list[dict[str, torch.Tensor]]:
    """``n`` sequences of 4–12 real tokens, unpadded (a collator pads them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lengths[0], lengths[1] + 1, (), generator=g))
        ids = torch.randint(1, V, (k,), generator=g)
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def pad(rows: list[dict[str, torch.Tensor]], to: int | None = None) -> dict[str, torch.Tensor]:
    """The padding collator: right-padded to the longest row (or ``to``); labels −100 there."""
    n = to or max(r["input_ids"].numel() for r in rows)
    fill = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.stack([torch.cat([r[k], r[k].new_full((n - r[k].numel(),), v)]) for r in rows])
            for k, v in fill.items()}


def causal_scored(labels: torch.Tensor) -> torch.Tensor:
    """What a shifted causal-LM loss scores: ``labels[:, t + 1] != −100``, never the last."""
    return torch.cat([labels[:, 1:] != -100, torch.zeros(labels.shape[0], 1, dtype=torch.bool)], 1)


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    model = build(family, **NO_DROPOUT[family]).train()
    batch = pad(_rows(2, 99))
    return tengrad_fx.prepare(model, example_inputs={k: batch[k] for k in ("input_ids", "attention_mask")})


def _opt(model: nn.Module, **kw: Any) -> tengrad_fx.TENGraD:
    args = dict(lr=0.5, damping=0.1, momentum=0.0, curvature_every=1, kl_clip=None, fisher="mc")
    args.update(kw)
    opt = tengrad_fx.TENGraD(model, **args)
    opt.seed_mc(SEED)
    return opt


def trainer_items(model: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    """The ``num_items_in_batch`` the ``Trainer`` divides the summed loss by: the labels its
    count rule takes (shifted only for a model whose ``loss_type`` names the causal loss, so
    not for GPT-2, whose ``loss_type`` is None) that are not −100."""
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    shifted = LOSS_MAPPING.get(getattr(model, "loss_type", None)) is ForCausalLMLoss
    return (labels[..., 1:] if shifted else labels).ne(-100).sum()


def _step(model: nn.Module, opt: tengrad_fx.TENGraD, batch: dict[str, torch.Tensor],
          mask: torch.Tensor | None | str = "auto", **kw: Any) -> None:
    out = model(**batch, **kw)
    opt.zero_grad()
    if mask != "auto":
        opt.mc_capture(out.logits, mask=mask)
    out.loss.backward()
    opt.step()


def _gap(a: nn.Module, b: nn.Module) -> float:
    return max(((p - q).norm() / q.norm()).item() for p, q in zip(a.parameters(), b.parameters()))


def _pair(family: str, **kw: Any) -> tuple[nn.Module, tengrad_fx.TENGraD, nn.Module, tengrad_fx.TENGraD]:
    a, b = _model(family), _model(family)
    return a, _opt(a, **kw), b, _opt(b, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_loop_without_a_call_equals_the_masked_step(family: str) -> None:
    """Two steps; and the every-position step (``mask`` all True) is far from it, so the
    comparison can fail."""
    a, opt_a, b, opt_b = _pair(family)
    batches = [pad(_rows(B, s)) for s in (1, 2)]
    for batch in batches:
        _step(a, opt_a, batch)
        _step(b, opt_b, batch, mask=causal_scored(batch["labels"]))
    assert _gap(a, b) <= TOL
    c = _model(family)
    opt_c = _opt(c)
    for batch in batches:
        _step(c, opt_c, batch, mask=torch.ones(B, batch["labels"].shape[1], dtype=torch.bool))
    assert _gap(c, b) > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_mask_alone_gives_its_nonzero_positions(family: str) -> None:
    """Without ``labels=`` (a loss computed outside the model) the mask is ``attention_mask``'s."""
    a, opt_a, b, opt_b = _pair(family)
    batch = pad(_rows(B, 4))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    for model, opt, mask in ((a, opt_a, "auto"), (b, opt_b, batch["attention_mask"].bool())):
        out = model(**inputs)
        opt.zero_grad()
        if mask != "auto":
            opt.mc_capture(out.logits, mask=mask)
        nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()).backward()
        opt.step()
    assert _gap(a, b) <= TOL


def test_an_explicit_mask_wins() -> None:
    a, opt_a, b, opt_b = _pair("gpt2")
    batch = pad(_rows(B, 5))
    mine = batch["attention_mask"].bool()  # not what the shifted loss scores
    for model, opt, inputs in ((a, opt_a, batch), (b, opt_b, {k: batch[k] for k in ("input_ids", "attention_mask")})):
        out = model(**inputs)  # with labels= (a) or without (b): the explicit mask either way
        opt.zero_grad()
        opt.mc_capture(out.logits, mask=mine)
        nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()).backward()
        opt.step()
    assert _gap(a, b) <= TOL


def test_sequence_logits_without_a_mask_warn_once() -> None:
    model = _model("gpt2")
    opt = _opt(model)
    batch = pad(_rows(B, 6))
    with pytest.warns(UserWarning, match=r"mc_capture\(logits, mask=") as caught:
        for _ in range(2):
            out = model(input_ids=batch["input_ids"])
            opt.zero_grad()
            out.logits.sum().backward()
            opt.step()
    assert sum("every position" in str(w.message) for w in caught) == 1


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_position_rows_fall_on_scored_positions_only(family: str, fisher: str, monkeypatch: Any) -> None:
    """Every drawn row is a scored position, and the step without a call equals the explicit
    masked one; with the empirical Fisher too (the mask comes from ``labels=``)."""
    draws: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    real = position_rows.scored_draw

    def spy(scored: torch.Tensor, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx, w = real(scored, k, generator)
        draws.append((scored, idx, w))
        return idx, w

    monkeypatch.setattr(position_rows, "scored_draw", spy)
    a, opt_a, b, opt_b = _pair(family, fisher=fisher, position_rows=40)
    batch = pad(_rows(B, 7))
    scored = causal_scored(batch["labels"])
    _step(a, opt_a, batch)
    _step(b, opt_b, batch, mask=scored if fisher == "mc" else "auto")
    assert draws and all(torch.equal(s, scored) for s, _, _ in draws)
    for s, idx, w in draws:
        assert bool(s.reshape(-1)[idx[w > 0]].all()) and int((w > 0).sum()) == min(40, int(scored.sum()))
    assert _gap(a, b) <= TOL


def test_masked_paths_read_nothing_back() -> None:
    """Reading the mask from the call and the masked MC draw: 0 host syncs."""
    model = _model("llama")
    opt = _opt(model, position_rows=16)
    batch = pad(_rows(B, 8))
    with SyncCounter() as sc:
        scored = scored_positions(model, batch)
    assert sc.count == 0 and torch.equal(scored, causal_scored(batch["labels"]))
    out = model(**batch)
    opt.zero_grad()
    with SyncCounter() as sc:
        opt.mc_capture(out.logits)
    assert sc.count == 0, dict(sc.ops)
    out.loss.backward()
    opt.step()


# --------------------------------------------------------------------------- other heads
def _bert(head: str) -> nn.Module:
    torch.manual_seed(0)
    t = transformers
    cfg = t.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, max_position_embeddings=16, num_labels=3,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = (t.BertForMaskedLM if head == "mlm" else t.BertForSequenceClassification)(cfg).double()
    batch = pad(_rows(2, 99))
    return tengrad_fx.prepare(model, example_inputs={k: batch[k] for k in ("input_ids", "attention_mask")})


def test_masked_lm_head_scores_labels_where_they_stand() -> None:
    """BERT's masked-LM loss is not shifted: the mask is ``labels != −100``."""
    a, b = _bert("mlm"), _bert("mlm")
    opt_a, opt_b = _opt(a), _opt(b)
    batch = pad(_rows(B, 9))
    g = torch.Generator().manual_seed(2)
    batch["labels"] = batch["labels"].masked_fill(torch.rand(batch["labels"].shape, generator=g) < 0.6, -100)
    _step(a, opt_a, batch)
    _step(b, opt_b, batch, mask=batch["labels"] != -100)
    assert _gap(a, b) <= TOL


def test_sequence_classification_head_is_unchanged() -> None:
    """Logits ``[B, C]``: no position mask fits; the step is the unmasked one, bit for bit."""
    a, b = _bert("cls"), _bert("cls")
    opt_a, opt_b = _opt(a), _opt(b)
    batch = pad(_rows(B, 10))
    batch["labels"] = torch.arange(B) % 3
    _step(a, opt_a, batch)
    _step(b, opt_b, batch, mask=None)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert tengrad_fx.get_info(a).store.scored is None


# --------------------------------------------------------------------------- trainers
class _InOrder:
    """A Trainer whose batches come in dataset order (as the reference loop takes them)."""

    @staticmethod
    def make(**kw: Any) -> Any:
        class InOrder(transformers.Trainer):
            def _get_train_sampler(self, *args: Any, **kwargs: Any) -> torch.utils.data.Sampler:
                return torch.utils.data.SequentialSampler(self.train_dataset)
        return InOrder(**kw)


def _train_hf(model: nn.Module, opt: tengrad_fx.TENGraD, rows: list[dict[str, torch.Tensor]], tmp: Path,
              bs: int, accumulate: int, steps: int, to: int | None = None) -> None:
    args = transformers.TrainingArguments(output_dir=str(tmp), max_steps=steps, per_device_train_batch_size=bs,
                                          gradient_accumulation_steps=accumulate, max_grad_norm=0.0,
                                          lr_scheduler_type="constant", use_cpu=True, report_to=[],
                                          save_strategy="no", disable_tqdm=True, seed=0)
    trainer = _InOrder.make(model=model, args=args, train_dataset=rows, optimizers=(opt, None),
                            data_collator=lambda r: pad(r, to))
    trainer.train()
    assert opt.counters == {"step": steps, "skipped": 0, "uncaptured": 0}


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_trainer_with_a_padding_collator(family: str, tmp_path: Path) -> None:
    a, opt_a, b, opt_b = _pair(family)
    rows = _rows(2 * B, 11)
    _train_hf(a, opt_a, rows, tmp_path, B, 1, 2)
    for i in (0, B):
        batch = pad(rows[i:i + B])
        _step(b, opt_b, batch, mask=causal_scored(batch["labels"]),
              num_items_in_batch=trainer_items(b, batch["labels"]))
    assert _gap(a, b) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_hf_trainer_accumulation_with_num_items_equals_the_whole_batch(family: str, fisher: str,
                                                                        tmp_path: Path) -> None:
    """``gradient_accumulation_steps=2`` over micro-batches of unequal token counts, the loss
    token-weighted by the Trainer's ``num_items_in_batch`` (the model's forward takes it):
    the step equals TENGraD on the whole batch's loss. Every batch is padded to ``L``, so
    the MC labels of the two micro-batches are those of one draw over the whole batch."""
    a, opt_a, b, opt_b = _pair(family, fisher=fisher)
    rows = _rows(B, 12, lengths=(2, L))
    _train_hf(a, opt_a, rows, tmp_path, B // 2, 2, 1, to=L)
    batch = pad(rows, L)
    _step(b, opt_b, batch, mask=causal_scored(batch["labels"]) if fisher == "mc" else "auto",
          num_items_in_batch=trainer_items(b, batch["labels"]))
    assert _gap(a, b) <= TOL
    assert {lay.m for lay in tengrad_fx.covered_layers(a)} == {B}


@pytest.mark.parametrize("family", FAMILIES)
def test_lightning_without_a_call_equals_the_masked_step(family: str, tmp_path: Path) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    a, opt_a, b, opt_b = _pair(family)
    rows = _rows(2 * B, 13)
    batches = [pad(rows[i:i + B]) for i in (0, B)]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = a

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return opt_a

    loader = torch.utils.data.DataLoader(rows, batch_size=B, shuffle=False, collate_fn=pad)  # type: ignore[arg-type]
    pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=str(tmp_path)).fit(Module(), loader)
    for batch in batches:
        _step(b, opt_b, batch, mask=causal_scored(batch["labels"]))
    assert _gap(a, b) <= TOL


LAYER = {"gpt2": "transformer.h.0.mlp.c_proj", "llama": "model.layers.0.mlp.down_proj"}


def _layer_io(family: str, batch: dict[str, torch.Tensor], targets: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """On an unprepared twin (same initial weights): the layer's input ``x [B, L, d_in]``,
    the gradient of the Fisher's loss w.r.t. its output ``G [B, L, d_out]`` (the sampled
    ``targets``' mean cross-entropy over the scored positions, or the training loss), and
    the training loss's gradient of the layer's parameters. Hooks are the test's own."""
    torch.manual_seed(0)
    model = build(family, **NO_DROPOUT[family]).train()
    layer = model.get_submodule(LAYER[family])
    seen: dict[str, torch.Tensor] = {}

    def keep(mod: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
        seen["x"] = args[0].detach()
        seen["out"] = out

    handle = layer.register_forward_hook(keep)
    res = model(**batch)
    handle.remove()
    params = dict(layer.named_parameters())
    g = dict(zip(params, torch.autograd.grad(res.loss, list(params.values()), retain_graph=True)))
    if targets is None:
        (G,) = torch.autograd.grad(res.loss, seen["out"])
    else:
        sampled = nn.functional.cross_entropy(res.logits.flatten(0, 1), targets.flatten())
        (G,) = torch.autograd.grad(sampled, seen["out"])
    return seen["x"], G, g


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_position_rows_equal_the_dense_reference_on_the_drawn_rows(family: str, fisher: str,
                                                                   monkeypatch: Any) -> None:
    """One layer of each family (GPT-2's transposed ``Conv1D`` with its bias, Llama's
    ``down_proj``): ``u = (JᵀJ/k + αI)⁻¹ g`` with row ``(i, t) = N·∂ℓ/∂W`` through that
    position's own output (``N·G_it ⊗ x_it``, bias ``N·G_it``) for the ``k`` drawn scored
    rows, ``N`` the scored count, built densely from an unprepared twin's autograd."""
    draws: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = position_rows.scored_draw
    monkeypatch.setattr(position_rows, "scored_draw",
                        lambda s, k, gen: draws.append(real(s, k, gen)) or draws[-1])
    alpha, k = 1.0, 24
    model = _model(family)
    opt = _opt(model, fisher=fisher, position_rows=k, damping=alpha, lr=1.0)
    batch = pad(_rows(B, 14))
    scored = causal_scored(batch["labels"])
    targets = None
    if fisher == "mc":
        g = torch.Generator().manual_seed(5)
        targets = torch.randint(0, V, scored.shape, generator=g).masked_fill(~scored, -100)
    layer = model.get_submodule(LAYER[family])
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    out = model(**batch)
    opt.zero_grad()
    if targets is not None:
        opt.mc_capture(out.logits, targets=targets)
    out.loss.backward()
    opt.step()
    u = torch.cat([(before[n] - p.detach()).flatten() for n, p in layer.named_parameters()])

    x, G, g = _layer_io(family, batch, targets)
    (idx, w), = draws
    rows = idx[w > 0]
    N = float(scored.sum())
    xr, Gr = x.reshape(-1, x.shape[-1])[rows], G.reshape(-1, G.shape[-1])[rows] * N
    weight = torch.einsum("ri,ro->rio", xr, Gr) if family == "gpt2" else torch.einsum("ro,ri->roi", Gr, xr)
    J = torch.cat([weight.flatten(1), Gr] if family == "gpt2" else [weight.flatten(1)], 1)
    grad = torch.cat([g[n].flatten() for n in before])
    F = J.T @ J / rows.numel()
    ref = torch.linalg.solve(F + alpha * torch.eye(F.shape[0], dtype=F.dtype), grad)
    assert ((u - ref).norm() / ref.norm()).item() <= TOL
