"""``tools.lm_verdict``: time to AdamW's final loss per seed, in AdamW's and Muon's units."""
from __future__ import annotations

import pytest

from testing.repo_tools import tool

lm_verdict = tool("lm_verdict")


def _run(method: str, losses: list[float], cost: float) -> dict:
    return {"method": method, "curve": [{"step": 10 * i, "est_seconds": 10 * i * cost, "test_loss": v}
                                        for i, v in enumerate(losses)]}


def _seed(fast: list[float]) -> dict:
    return {"runs": [_run("adamw", [5.0, 3.0, 2.5, 2.0], 1.0), _run("muon", [5.0, 2.8, 2.0, 1.8], 1.1),
                     _run("tg", fast, 1.2), _run("tg-off", [5.0, 2.9, 2.1, 1.9], 1.2),
                     _run("plain", [5.0, 4.0, 3.5, 3.0], 1.1)]}


def test_times_to_adamw_final_loss() -> None:
    target, times = lm_verdict.seed_times(_seed([5.0, 2.0, 1.9, 1.8]))
    assert target == 2.0
    assert times["adamw"] == 30.0 and times["muon"] == pytest.approx(22.0) and times["tg"] == pytest.approx(12.0)
    assert times["plain"] is None


def test_verdict_lines() -> None:
    text = lm_verdict.verdict([_seed([5.0, 2.0, 1.9, 1.8]), _seed([5.0, 2.2, 1.9, 1.8])], "tg", "tg-off", "plain")
    assert "| tg | 0.40 0.80 (mean 0.60) |" in text
    assert "curvature off (tg-off) / on (tg), time to the target: 3.00 1.50 (mean 2.25)" in text
    assert "without the polar factor (plain), × AdamW's time: - - (mean -)" in text


def test_needs_adamw() -> None:
    with pytest.raises(ValueError, match="adamw"):
        lm_verdict.seed_times({"runs": [_run("muon", [1.0], 1.0)]})
