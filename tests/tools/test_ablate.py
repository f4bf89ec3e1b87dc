"""``tools.ablate``: variant specs, the steps-to-target table, and a tiny end-to-end run
(two TENGraD variants and SGD on the synthetic Fashion-MNIST, two seeds)."""
from __future__ import annotations

import json

import pytest

from testing.repo_tools import tool

ablate = tool("ablate")


def test_parse_variant() -> None:
    assert ablate.parse_variant("w:curvature_warmup=5,damping=0.03,kl_clip=None,graft=sgd") == (
        "w", {"curvature_warmup": 5, "damping": 0.03, "kl_clip": None, "graft": "sgd"})
    assert ablate.parse_variant("lr=0.01") == ("lr=0.01", {"lr": 0.01})
    with pytest.raises(ValueError, match="key=value"):
        ablate.parse_variant("x:damping")


def test_table_mean_and_spread() -> None:
    def rows(name: str, accs: list[list[float]]) -> list[dict]:  # type: ignore[type-arg]
        return [{"method": name, "seed": s, "curve": [{"step": 25 * i, "test_acc": a} for i, a in enumerate(c)]}
                for s, c in enumerate(accs)]

    text = ablate.table(rows("a", [[0.1, 0.86, 0.9], [0.1, 0.5, 0.89]]) + rows("b", [[0.1, 0.2, 0.3]] * 2),
                        [0.85, 0.88], [25, 50])
    lines = text.splitlines()
    assert lines[0] == "| variant | steps to 85% | steps to 88% | acc. @ 25 | acc. @ 50 |"
    assert lines[2] == "| a | 38 ± 12 | 50 ± 0 | 68.0 ± 18.0 | 89.5 ± 0.5 |"
    assert lines[3] == "| b | – (0/2) | – (0/2) | 20.0 ± 0.0 | 30.0 ± 0.0 |"


def test_end_to_end(data_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    ablate.main(["--model", "tiny", "--data-dir", str(data_dir), "--variants", "paper",
                 "--tengrad", "w:curvature_warmup=2,graft=rmsprop,lr=1e-3", "--peers", "sgd", "--seeds", "0,1",
                 "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--eval-subset", "16",
                 "--at", "2,4", "--threads", "1", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["method"], r["seed"]) for r in res["runs"]] == [(m, s) for s in (0, 1) for m in ("paper", "w", "sgd")]
    for r in res["runs"]:
        assert [c["step"] for c in r["curve"]] == [0, 2, 4] and r["diverged_at"] is None
    rows = [ln.split(" | ")[0] for ln in (tmp_path / "table.md").read_text().splitlines() if ln.startswith("| ")]
    assert rows == ["| variant", "| paper", "| w", "| sgd"]


def test_cosine_schedule_reaches_every_run(data_dir, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``--schedule cosine``: every run's lr (TENGraD's and the peer's) follows the cosine over
    ``--steps``, down to 0 after the last step; the config records it."""
    runs, make_run = [], ablate.make_run

    def recording_make_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        runs.append(make_run(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(ablate, "make_run", recording_make_run)
    res = ablate.main(["--model", "tiny", "--data-dir", str(data_dir), "--variants", "paper", "--peers", "sgd",
                       "--steps", "4", "--batch-size", "8", "--eval-every", "2", "--eval-subset", "16",
                       "--at", "4", "--schedule", "cosine", "--threads", "1"])
    assert res["config"]["schedule"] == "cosine"
    assert [r.method.name for r in runs] == ["paper", "sgd"]
    for r in runs:
        assert r.sched is not None and len(r.times) == 4
        assert all(g["lr"] == pytest.approx(0.0, abs=1e-12) for g in r.opt.param_groups)


def test_preset_variant_takes_the_preset_lr() -> None:
    from tengrad_fx.optim.registry import PRESETS

    fast = PRESETS["tengrad"]["fast"]
    assert ablate.tengrad_method("f", {"preset": "fast"}).lr == fast["lr"]
    assert ablate.tengrad_method("f", {"preset": "fast", "lr": 0.5}).lr == 0.5
    assert ablate.tengrad_method("p", {}).lr == 0.003  # the paper's Fashion-MNIST lr


def test_peer_at_another_lr() -> None:
    assert ablate.peer_method("muon") is ablate.METHODS["muon"]
    m = ablate.peer_method("muon@0.06")
    assert (m.name, m.lr, m.build) == ("muon@0.06", 0.06, ablate.METHODS["muon"].build)
