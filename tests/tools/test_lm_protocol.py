"""The language-model protocol (``tools.lm_protocol``, ``tools.protocol_table``,
``tools.lm_verdict --protocol``): AdamW's budget interpolation and the speedups on synthetic
curves, the warm-up + cosine schedule, the edge flags, the grids and twins, and a few steps
of the whole protocol on the tiny GPT-2 trained on this repository's documentation."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from testing.repo_tools import tool

table = tool("protocol_table")
proto = tool("lm_protocol")
lr_grid = tool("lr_grid")

BUDGETS = [100.0, 200.0, 400.0]


def test_adamw_budget_on_a_curve_linear_in_log_budget() -> None:
    """AdamW's loss 3 − ¼·log2(b/100): a loss L is reached at b = 100·2^{4(3 − L)}, exactly."""
    losses = [3 - 0.25 * math.log2(b / 100) for b in BUDGETS]
    assert losses == [3.0, 2.75, 2.5]
    for loss in (2.9, 2.75, 2.6, 2.5):
        b, rel = table.adamw_budget(BUDGETS, losses, loss)
        assert rel == "=" and b == pytest.approx(100 * 2 ** (4 * (3 - loss)))
    s, rel = table.speedup(BUDGETS, losses, 2.875, 100)
    assert (s, rel) == (pytest.approx(2 ** 0.5), "=")
    s, rel = table.speedup(BUDGETS, losses, 2.6, 200)  # a 2B run: AdamW's 100·2^1.6 steps over 200
    assert (s, rel) == (pytest.approx(2 ** 0.6), "=")
    # out of AdamW's range: bounds, not extrapolation
    assert table.speedup(BUDGETS, losses, 2.4, 100) == (4.0, ">")
    assert table.speedup(BUDGETS, losses, 2.4, 200) == (2.0, ">")
    assert table.speedup(BUDGETS, losses, 3.1, 200) == (0.5, "<")
    assert table.speedup(BUDGETS, losses, 3.0, 100) == (1.0, "=")
    with pytest.raises(ValueError, match="not finite"):
        table.speedup(BUDGETS, losses, math.nan, 100)


def test_adamw_budget_piecewise_and_first_crossing() -> None:
    """Loss 2 + 100/b (3, 2.5, 2.25): linear in log budget between the points only; a curve
    that rises again is read at its first crossing."""
    losses = [2 + 100 / b for b in BUDGETS]
    b, _ = table.adamw_budget(BUDGETS, losses, 2.4)  # (2.5 − 2.4)/(2.5 − 2.25) = 0.4 of [200, 400]
    assert b == pytest.approx(200 * 2 ** 0.4)
    b, _ = table.adamw_budget(BUDGETS, losses, 2.9)  # 0.1/0.5 = 0.2 of [100, 200]
    assert b == pytest.approx(100 * 2 ** 0.2)
    b, rel = table.adamw_budget(BUDGETS, [3.0, 2.5, 2.7], 2.6)  # 0.4/0.5 of the first segment
    assert rel == "=" and b == pytest.approx(100 * 2 ** 0.8)


def _rows(method: str, budget: int, lr_losses: dict[float, list[float]], cost: float) -> list[dict]:  # type: ignore[type-arg]
    return [{"method": method, "budget": budget, "seed": s, "lr": lr, "loss": v, "cost": cost}
            for lr, vs in lr_losses.items() for s, v in enumerate(vs)]


def test_aggregate_best_lr_edges_and_speedups() -> None:
    """Best lr by the mean over seeds (a diverged seed loses), the loss's mean ± half range,
    speedups per step and in time (× AdamW's step cost over the method's, same budget)."""
    rows = (_rows("adamw", 100, {1e-3: [3.1, 2.9], 2e-3: [3.05, 3.05], 4e-3: [3.2, 3.2]}, 1.0)
            + _rows("adamw", 200, {1e-3: [2.8, 2.8], 2e-3: [2.75, 2.75], 4e-3: [2.9, 2.9]}, 1.0)
            + _rows("adamw", 400, {1e-3: [2.5, 2.5], 2e-3: [2.6, 2.6], 4e-3: [2.7, 2.7]}, 1.0)
            + _rows("tg", 100, {1e-4: [2.9, 2.85], 2e-4: [2.875, math.nan], 4e-4: [2.95, 2.95]}, 1.25)
            + _rows("tg", 200, {1e-4: [2.7], 2e-4: [2.4, 2.7, 2.7], 4e-4: [2.6]}, 1.6)
            + _rows("off", 100, {1e-4: [math.nan, 2.9]}, 1.2))
    model = {"budget": 100, "methods": ["adamw", "tg", "off"], "rows": rows, "dirs": ["OUT"],
             "base_args": ["--model", "gpt2-bytes-s"], "method_args": {"adamw": ["--methods", "adamw"],
                                                                       "tg": ["--tengrad", "tg:preset=lm"],
                                                                       "off": ["--tengrad", "off:damping=1000"]}}
    agg = table.aggregate(model)
    a = agg["adamw"]
    assert [a[b]["lr"] for b in (100, 200, 400)] == [1e-3, 2e-3, 1e-3]
    assert a[100]["loss"] == pytest.approx(3.0) and a[100]["spread"] == pytest.approx(0.1)
    assert a[100]["edge"] == {"side": "low", "next": [5e-4]} and a[200]["edge"] is None
    tg = agg["tg"]
    assert tg[100]["lr"] == 1e-4 and tg[100]["loss"] == pytest.approx(2.875)  # 2e-4 diverged on seed 1
    assert tg[100]["edge"] == {"side": "low", "next": [5e-5]}
    # AdamW's curve 3.0, 2.75, 2.5 is 3 − ¼·log2(b/100): 2.875 → 100·√2 steps, over 100
    assert tg[100]["speedup_step"] == (pytest.approx(2 ** 0.5), "=")
    assert tg[100]["speedup_time"] == (pytest.approx(2 ** 0.5 / 1.25), "=")
    # at 2B the lrs compare on seed 0 (the one every lr ran); the best one's loss is over its 3 seeds
    assert tg[200]["lr"] == 2e-4 and tg[200]["loss"] == pytest.approx(2.6) and tg[200]["seeds"] == 3
    # 2.6 on AdamW's curve: 100·2^1.6 steps, over 200
    assert tg[200]["speedup_step"] == (pytest.approx(2 ** 0.6), "=")
    assert tg[200]["speedup_time"] == (pytest.approx(2 ** 0.6 / 1.6), "=")
    assert agg["off"][100]["speedup_step"] is None and agg["off"][100]["edge"]["side"] == "single"
    text = table.table("gpt2-bytes-s", model, agg)
    assert "| tg | 0.0001 (low edge) / 0.0002 / – | 2.8750 ± 0.0250 (2 of 3) | 2.6000 ± 0.1500 | – | " \
           "1.41x at 1B / 1.52x at 2B | 1.13x at 1B / 0.947x at 2B | 1.25 / 1.60 |" in text
    assert "| off | 0.0001 (single edge) / – / – | diverged (2 of 3) | – | – | – at 1B | – at 1B | 1.20 |" in text
    assert "edge: tg: best lr 0.0001 the low point of [0.0001, 0.0002, 0.0004] at 1B; run the next: " \
           "python -m tools.lm_protocol --model gpt2-bytes-s --tengrad tg:preset=lm --lr-grid-for tg=5e-05 " \
           "--multiples 1 --out OUT-extra" in text
    assert "--lr-grid-for 'adamw=0.001:3' --lr-grid-for 'tg=0.0001:3'" in text
    with pytest.raises(ValueError, match="no 'adamw'"):
        table.aggregate({**model, "methods": ["tg"], "rows": [r for r in rows if r["method"] == "tg"]})


def test_edge() -> None:
    grid = lr_grid.lr_grid(1e-3, 5, 2.0)
    assert grid == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    assert table.edge(grid, 4e-3) == {"side": "high", "next": [8e-3]}
    assert table.edge(grid, 2.5e-4) == {"side": "low", "next": [1.25e-4]}
    assert all(table.edge(grid, lr) is None for lr in grid[1:-1])
    assert table.edge([1e-3, 3e-3], 3e-3) == {"side": "high", "next": [9e-3]}  # the grid's own step
    assert table.edge([1e-3], 1e-3) == {"side": "single", "next": [5e-4, 2e-3]}


def test_warmup_then_cosine_to_zero() -> None:
    """Warm-up over 2 of 10 steps ((t + 1)/2), then ½(1 + cos(π(t − 2)/8)): on the LambdaLR of a
    run, the lr of every step, and exactly 0 after the last one."""
    import torch

    peer_bench = tool("peer_bench")
    f = lr_grid.lr_multiplier("cosine", 10, warmup=2)
    expect = [0.5, 1.0] + [0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]
    assert [f(t) for t in range(11)] == pytest.approx(expect) and f(10) == 0.0
    assert [lr_grid.lr_multiplier("constant", 4, 3)(t) for t in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])
    with pytest.raises(ValueError, match="--lr-warmup"):
        lr_grid.lr_multiplier("cosine", 10, warmup=10)
    base = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x, y = torch.randn(6, 1, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2])
    run = peer_bench.make_run(peer_bench.METHODS["adamw"], 0.1, base, x, "cosine", 10, warmup=2)
    for t in range(10):
        assert run.opt.param_groups[0]["lr"] == pytest.approx(0.1 * expect[t])
        run.step(x, y, lambda: None)
    assert run.opt.param_groups[0]["lr"] == 0.0


def test_muon_torch_covers_every_parameter_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``muon-torch``: torch's Muon on the hidden matrices, AdamW on the rest, every parameter in
    exactly one; a scheduler on the pair sets both lrs; a step moves both."""
    import torch

    pytest.importorskip("transformers")
    methods = tool("peer_methods")
    model, _ = tool("lm_workloads").build_lm("gpt2-bytes-t")
    opt = methods.METHODS["muon-torch"].make(model, 1e-3)
    muon, adamw = opt.inner
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    ids = [id(p) for o in opt.inner for g in o.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())  # each exactly once
    named = {id(p): n for n, p in model.named_parameters()}
    hidden = sorted(named[id(p)] for g in muon.param_groups for p in g["params"])
    assert "transformer.h.0.attn.c_attn.weight" in hidden
    assert not {"transformer.wte.weight", "transformer.wpe.weight"} & set(hidden)
    assert all(p.ndim == 2 for g in muon.param_groups for p in g["params"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randint(0, 256, (2, 16))
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), x.flatten()).backward()
    opt.step()
    sched.step()
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == pytest.approx(5e-4)
    moved = {named[id(p)] for p, b in zip(model.parameters(), before) if not torch.equal(p, b)}
    assert "transformer.h.0.attn.c_attn.weight" in moved and "transformer.ln_f.weight" in moved
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(ImportError, match=r"torch ≥ 2.9"):
        methods.METHODS["muon-torch"].make(model, 1e-3)


def test_twins_grids_and_budgets(capsys: pytest.CaptureFixture[str]) -> None:
    methods = tool("peer_methods")
    specs = proto.twins(["lm:preset=lm"])
    assert specs == ["lm:preset=lm", "lm-off:preset=lm,damping=1000.0"]
    off = methods.tengrad_method(*methods.parse_variant(specs[1]))
    assert off.options["damping"] == 1000.0 and off.options["metric"] == "factored" and off.lr == 3e-4
    grids = proto.method_grids(["adamw"], specs, 5, ["lm=1e-4:3"])
    assert grids["adamw"] == [2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3]
    assert grids["lm"] == grids["lm-off"] == [5e-5, 1e-4, 2e-4]
    assert proto.method_grids(["adamw"], specs, 3, [])["lm-off"] == [1.5e-4, 3e-4, 6e-4]
    with pytest.raises(ValueError, match="does not run"):
        proto.method_grids(["adamw"], [], 5, ["soap=1e-3:3"])
    with pytest.raises(SystemExit):
        proto.parse_args(["--model", "gpt2-bytes-t", "--budget", "2", "--out", "o", "--tengrad", "a:damping=1",
                          "--tengrad", "a:damping=2"])
    assert "distinct names" in capsys.readouterr().err
    assert proto.budgets_of(150, [1, 2, 4], "adamw") == [150, 300, 600]
    assert proto.budgets_of(150, [1, 2, 4], "lm") == [150, 300]


def test_protocol_end_to_end(docs_text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Budgets of 2, 4 (and AdamW's 8) steps, 2 lrs, 1 seed on the tiny GPT-2: the results tree,
    each race's schedule and grids, the resumed rerun, an extra lr point merged, the table."""
    pytest.importorskip("transformers")
    lm_verdict = tool("lm_verdict")
    common = ["--model", "gpt2-bytes-t", "--budget", "2", "--seeds", "0", "--text", str(docs_text),
              "--batch-size", "4", "--eval-subset", "4", "--threads", "1", "--warmup", "0", "--warmup-frac", "0.25"]
    argv = [*common, "--methods", "adamw", "--tengrad", "lm:preset=lm", "--lr-grid-for", "adamw=1e-3,2e-3",
            "--lr-grid-for", "lm=1e-4,3e-4", "--out", str(tmp_path / "p")]
    spec = proto.main(argv)
    assert spec["methods"] == ["adamw", "lm", "lm-off"]
    assert spec["budgets"] == {"adamw": [2, 4, 8], "lm": [2, 4], "lm-off": [2, 4]}
    extra = proto.parse_args([*spec["method_args"]["lm-off"], "--model", "gpt2-bytes-t", "--budget", "2", "--out", "o"])
    assert extra.methods == [] and extra.tengrad == ["lm-off:preset=lm,damping=1000.0"]  # reruns that setting alone
    assert sorted(str(p.relative_to(tmp_path / "p")) for p in (tmp_path / "p").glob("*/*/results.json")) == \
        ["b2/seed0/results.json", "b4/seed0/results.json", "b8/seed0/results.json"]
    res = json.loads((tmp_path / "p/b8/seed0/results.json").read_text())
    cfg = res["config"]
    assert cfg["steps"] == 8 and cfg["schedule"] == "cosine" and cfg["lr_warmup"] == 2
    assert cfg["lr_grids"] == {"sgd": [0.03], "adamw": [1e-3, 2e-3]}
    assert all(r["steps"] == 8 and [c["step"] for c in r["curve"]] == [0, 8] for r in res["runs"])
    b4 = json.loads((tmp_path / "p/b4/seed0/results.json").read_text())
    assert b4["config"]["lr_grids"]["lm-off"] == [1e-4, 3e-4]
    assert "'damping': 1000.0" in next(r["settings"] for r in b4["runs"] if r["method"] == "lm-off")
    capsys.readouterr()
    proto.main(argv)  # resumed: every race is there
    assert capsys.readouterr().out.count("is there, not run again") == 3
    proto.main([*common, "--methods", "adamw", "--lr-grid-for", "adamw=4e-3", "--multiples", "1",
                "--out", str(tmp_path / "x")])
    text = lm_verdict.main(["--protocol", str(tmp_path / "p"), str(tmp_path / "x")])
    assert text.startswith("gpt2-bytes-t: B = 2 steps; 1B = 2, 2B = 4, 4B = 8; 1 seed(s)")
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) == {"method", "adamw", "lm", "lm-off"}
    agg = table.aggregate(table.load([str(tmp_path / "p"), str(tmp_path / "x")])["gpt2-bytes-t"])
    assert agg["adamw"][2]["grid"] == [1e-3, 2e-3, 4e-3] and agg["adamw"][4]["grid"] == [1e-3, 2e-3]
    assert all(math.isfinite(e["loss"]) and e["speedup_step"] is not None for per in agg.values() for e in per.values())
    with pytest.raises(ValueError, match="give each run once"):
        table.load([str(tmp_path / "x"), str(tmp_path / "x")])
