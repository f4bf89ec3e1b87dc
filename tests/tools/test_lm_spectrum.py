"""``tools.lm_spectrum``: the per-layer curvature spectrum after each curvature step of a
TENGraD variant on the tiny GPT-2, trained on this repository's docs."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from testing.repo_tools import tool

pytest.importorskip("transformers")
lm_spectrum = tool("lm_spectrum")


@pytest.mark.parametrize("damping,held", [(1e-6, True), (1e3, False)])
def test_spectra_after_each_curvature_step(docs_text: Path, damping: float, held: bool,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = lm_spectrum.main(["--model", "gpt2-bytes-t", "--text", str(docs_text), "--steps", "3",
                            "--batch-size", "4", "--layers",
                            "--tengrad", f"v:preset=lm,curvature_every=2,position_rows=16,damping={damping}"])
    assert [o["step"] for o in out] == [1, 3]
    spec = out[-1]["spectrum"]
    assert any(".attn." in name for name in spec) and any(".mlp." in name for name in spec)
    for s in spec.values():
        assert s["damping"] == damping and 0.0 <= s["above_damping"] <= 1.0
        assert math.isfinite(s["largest"]) and s["largest"] >= s["mean"] >= 0.0
    shares = [s["above_damping"] for s in spec.values()]
    assert (min(shares) >= 0.5) if held else (max(shares) == 0.0)  # tiny α: curvature everywhere; huge: none
    text = capsys.readouterr().out
    assert "after step 3 (curvature step 2)" in text and "| layer | rows |" in text


def test_protocol_schedule_sets_the_lr(docs_text: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--lr`` with ``--schedule cosine --lr-warmup``: the run's lr follows the protocol's
    schedule (warm-up, then cosine to 0 at ``--steps``)."""
    lrs: list[float] = []
    real_make_run = lm_spectrum.make_run

    def spy(*a: object, **k: object) -> object:
        r = real_make_run(*a, **k)
        step = r.step

        def logged(*sa: object) -> None:
            lrs.append(r.opt.param_groups[0]["lr"])
            step(*sa)
        r.step = logged
        return r
    monkeypatch.setattr(lm_spectrum, "make_run", spy)
    lm_spectrum.main(["--model", "gpt2-bytes-t", "--text", str(docs_text), "--steps", "4", "--batch-size", "4",
                      "--tengrad", "v:preset=lm,position_rows=16", "--lr", "0.01", "--schedule", "cosine",
                      "--lr-warmup", "2"])
    assert lrs[0] < lrs[1] and math.isclose(max(lrs), 0.01) and lrs[-1] < 0.01
