"""``tools.peer_seeds``: several ``tools.peer_bench`` outputs (one per seed) as one table and verdict."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from testing.repo_tools import tool

peer_seeds = tool("peer_seeds")


def result(rows: dict[str, tuple[str, float, list[int | None], float]]) -> dict[str, Any]:
    """A ``results.json`` with, per method, (family, ratio_to_sgd, steps to 0.85 / 0.88, final acc)."""
    summary = {m: {"family": fam, "ratio_to_sgd": cost, "final_acc": acc,
                   "targets": {t: None if s is None else {"steps": s}
                               for t, s in zip(("0.85", "0.88"), steps)}}
               for m, (fam, cost, steps, acc) in rows.items()}
    return {"summary": summary}


SEEDS = [
    result({"sgd": ("baseline", 1.0, [150, None], 0.87), "tengrad-x": ("tengrad", 1.2, [50, 100], 0.91),
            "muon": ("rival", 1.5, [50, 75], 0.90), "adamw": ("rival", 1.0, [100, 150], 0.89)}),
    result({"sgd": ("baseline", 1.0, [175, 300], 0.88), "tengrad-x": ("tengrad", 1.4, [75, 100], 0.93),
            "muon": ("rival", 1.7, [50, 125], 0.92), "adamw": ("rival", 1.0, [100, None], 0.87)}),
]


def test_aggregate_means_spreads_and_times() -> None:
    agg = peer_seeds.aggregate(SEEDS)
    tg = agg["tengrad-x"]
    assert tg["cost"] == pytest.approx(1.3)
    assert tg["targets"]["0.85"] == {"steps_mean": 62.5, "steps_spread": 12.5, "reached": 2,
                                     "time": pytest.approx(62.5 * 1.3)}
    assert tg["final_acc_mean"] == pytest.approx(0.92) and tg["final_acc_spread"] == pytest.approx(0.01)
    # A target one seed missed: its steps over the seeds that reached it, and no time.
    assert agg["adamw"]["targets"]["0.88"] == {"steps_mean": 150, "steps_spread": 0, "reached": 1, "time": None}
    assert agg["sgd"]["targets"]["0.88"]["time"] is None


def test_verdict_takes_the_least_time_of_each_family() -> None:
    v = peer_seeds.verdict(peer_seeds.aggregate(SEEDS))
    # to 85 %: tengrad-x 62.5 · 1.3 = 81.25 against muon 50 · 1.6 = 80 (adamw: 100).
    assert v["targets"]["0.85"]["rival"] == {"method": "muon", "time": pytest.approx(80.0)}
    assert v["targets"]["0.85"]["ratio"] == pytest.approx(81.25 / 80)
    # to 88 %: adamw missed it on one seed, so muon (100 · 1.6) is the rival.
    assert v["targets"]["0.88"]["rival"]["method"] == "muon"
    assert v["targets"]["0.88"]["ratio"] == pytest.approx(130 / 160)
    assert v["final_acc"]["tengrad"]["method"] == "tengrad-x"
    assert v["final_acc"]["rival"] == {"method": "muon", "final_acc": pytest.approx(0.91)}


def test_family_of_a_registered_method_when_not_stored() -> None:
    def without_family(rename: dict[str, str]) -> list[dict[str, Any]]:
        return [{"summary": {rename.get(m, m): {k: v for k, v in s.items() if k != "family"}
                             for m, s in r["summary"].items()}} for r in SEEDS]

    agg = peer_seeds.aggregate(without_family({"tengrad-x": "tengrad-orth-ns"}))
    assert [a["family"] for a in agg.values()] == ["baseline", "tengrad", "rival", "rival"]
    # a --tengrad variant's name says nothing about it: refused, not guessed
    with pytest.raises(ValueError, match="'tengrad-x' has no 'family'"):
        peer_seeds.aggregate(without_family({}))


def test_runs_of_other_methods_are_refused() -> None:
    other = result({"sgd": ("baseline", 1.0, [150, None], 0.87)})
    with pytest.raises(ValueError, match="same --methods"):
        peer_seeds.aggregate([SEEDS[0], other])


def test_main_reads_output_directories_and_writes_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = []
    for i, res in enumerate(SEEDS):
        d = tmp_path / f"s{i}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(res))
        dirs.append(str(d))
    out = peer_seeds.main([*dirs, "--out", str(tmp_path / "t.md"), "--json", str(tmp_path / "v.json")])
    text = capsys.readouterr().out
    assert "| tengrad-x | 1.30 | 62 ± 12 | 100 ± 0 | 81 | 130 | 92.0 ± 1.0 % |" in text
    assert "| adamw | 1.00 | 100 ± 0 | 150 ± 0 (1 of 2) | 100 | – | 88.0 ± 1.0 % |" in text
    assert "to 0.88: tengrad-x 130 SGD steps, muon 160 SGD steps: 0.81x" in text
    assert "final accuracy: tengrad-x 0.9200, muon 0.9100" in text
    assert (tmp_path / "t.md").read_text() == text
    assert json.loads((tmp_path / "v.json").read_text())["verdict"] == out["verdict"]


def test_other_targets_from_the_evaluations() -> None:
    def run(curve: list[float], cost: float) -> dict[str, Any]:
        acc_at = {str(25 * i): a for i, a in enumerate(curve)}
        return {"summary": {"tengrad": {"family": "tengrad", "ratio_to_sgd": cost, "final_acc": curve[-1],
                                        "acc_at": acc_at, "targets": {"0.85": None}},
                            "soap": {"family": "rival", "ratio_to_sgd": 1.0, "final_acc": 0.86,
                                     "acc_at": {"0": 0.1, "25": 0.86, "50": 0.86}, "targets": {"0.85": None}}}}

    seeds = [run([0.1, 0.8, 0.875], 1.2), run([0.1, 0.87, 0.88], 1.4)]
    agg = peer_seeds.aggregate(seeds, ["0.87", "0.9"])
    assert agg["tengrad"]["targets"]["0.87"] == {"steps_mean": 37.5, "steps_spread": 12.5, "reached": 2,
                                                 "time": pytest.approx(37.5 * 1.3)}
    assert agg["tengrad"]["targets"]["0.9"]["reached"] == 0 and agg["soap"]["targets"]["0.87"]["time"] is None
    v = peer_seeds.verdict(agg)
    assert v["targets"]["0.87"] == {"tengrad": {"method": "tengrad", "time": pytest.approx(48.75)}, "rival": None,
                                    "ratio": None}
