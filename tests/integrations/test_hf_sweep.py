"""The language-model sweep (:mod:`tools.hf_sweep`): transformers' causal-LM and
sequence-classification families from tiny random configs, prepared with keyword
``example_inputs`` (``input_ids``, ``attention_mask``), covered by parameter count and
every covered layer's per-sample gradients and Gram equal to ``torch.func``'s (float64).

The default suite runs a handful of families; the whole sweep is marked ``slow``.
"""
from __future__ import annotations

import pytest

from testing.repo_tools import tool

pytest.importorskip("transformers")
hf_sweep = tool("hf_sweep")

# (family, head): each fully covered and exact
FAST = [("gpt2", "causal"), ("mixtral", "causal"), ("llama", "causal"), ("opt", "causal"), ("gemma", "causal"),
        ("falcon", "causal"), ("roberta", "causal"), ("bert", "seqcls"), ("mistral", "seqcls"),
        ("mamba", "causal"), ("jetmoe", "causal")]  # replayed per sample: a scan, non-HF experts


@pytest.mark.parametrize("family,kind", FAST)
def test_family_covered_and_exact(family: str, kind: str) -> None:
    row = hf_sweep.sweep_one(family, kind)
    assert not row.skipped, row.skipped
    assert row.coverage is not None and row.coverage >= 0.99, (row.coverage, row.reasons)
    assert row.exact == "yes", row.exact


def test_float32_inside_is_told_apart() -> None:
    """Qwen3-Next's linear attention runs in float32 inside a float64 model: its replayed
    decay parameters differ from ``torch.func`` by that rounding only (exact with those
    casts made float64)."""
    row = hf_sweep.sweep_one("qwen3_next", "causal")
    assert row.coverage is not None and row.coverage >= 0.99, (row.coverage, row.reasons)
    assert row.exact == "yes (float32 inside)", row.exact


def test_tiny_config_shrinks_every_size() -> None:
    cfg = hf_sweep.tiny_config("llama")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.vocab_size) == \
        (hf_sweep.WIDTH, 2, 2, hf_sweep.VOCAB)
    assert cfg.pad_token_id is not None and cfg.pad_token_id < hf_sweep.VOCAB


def test_markdown_lists_skipped_and_counts() -> None:
    rows = [hf_sweep.Row("a", "causal", 1.0, "yes"), hf_sweep.Row("b", "causal", 0.5, "yes", ["why"]),
            hf_sweep.Row("c", "causal", skipped="does not build")]
    text = hf_sweep.markdown(rows)
    assert "2 of 3" in text and "1 of them (50 %)" in text
    assert "| b | causal | 50.00 % | yes | why |" in text and "- c (causal): does not build" in text


def test_write_table_between_markers(tmp_path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(f"before\n{hf_sweep.START}\nold\n{hf_sweep.END}\nafter\n")
    hf_sweep.write_table(str(doc), "new")
    assert doc.read_text() == f"before\n{hf_sweep.START}\nnew\n{hf_sweep.END}\nafter\n"
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        hf_sweep.write_table(str(doc), "new")


@pytest.mark.slow
def test_full_sweep() -> None:
    """Every (family, head) pair that builds tiny: no covered layer inexact, and at least
    95 % of them at ≥ 99 % coverage (docs/coverage.md)."""
    rows = list(hf_sweep.sweep(["causal", "seqcls"]))
    built = [r for r in rows if not r.skipped]
    good = [r for r in built if (r.coverage or 0) >= 0.99]
    inexact = [(r.family, r.exact) for r in built if r.exact.startswith(("no:", "error:"))]
    assert not inexact, inexact
    assert len(good) >= 0.95 * len(built), hf_sweep.markdown(rows)
