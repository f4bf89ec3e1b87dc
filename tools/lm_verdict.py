"""Time to AdamW's final validation loss, over seeds: the language-model race's verdict.

    python -m tools.lm_verdict RUN_DIR [RUN_DIR ...] [--setting NAME] [--off NAME] [--plain NAME]
    python -m tools.lm_verdict --protocol OUT [OUT ...]

Each ``RUN_DIR`` holds one ``tools.peer_bench`` run (``results.json``) of a language model,
one seed. Per seed, the target is AdamW's validation loss at its last step; each method's
time to it is the estimated seconds (steps × its interleaved step cost, in SGD steps) at
its first evaluation at or below the target. Printed per method: the time in AdamW's and in
Muon's units, per seed and as the mean of the seeds' ratios (not reached: ``-``). With
``--setting``/``--off``: the ratio of the curvature-off twin's time to the setting's (the
curvature earns its place at ≥ 1.25); ``--plain``: a setting without the polar factor.

``--protocol``: the arguments are results trees of ``tools.lm_protocol`` (Wen et al.'s
protocol: per-method lr grids, budgets B, 2B and AdamW's 4B, warm-up then cosine to 0);
printed per model: each method's best lr per budget (flagged at its grid's edge, with the
command for the next lr), its final loss at each budget over the seeds, and its speedup over
AdamW per step and in time (:mod:`tools.protocol_table`).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Optional

from tools.protocol_table import aggregate, load, table


def time_to(run: dict[str, Any], target: float) -> Optional[float]:
    """Estimated seconds at ``run``'s first evaluation at or below ``target`` (None: never)."""
    return next((c["est_seconds"] for c in run["curve"] if c["test_loss"] <= target), None)


def seed_times(result: dict[str, Any]) -> tuple[float, dict[str, Optional[float]]]:
    """(AdamW's final loss, ``{method: time to it}``) of one seed's results."""
    runs = {r["method"]: r for r in result["runs"]}
    if "adamw" not in runs:
        raise ValueError("tools.lm_verdict: the runs hold no 'adamw' (the target's method)")
    target = runs["adamw"]["curve"][-1]["test_loss"]
    return target, {m: time_to(r, target) for m, r in runs.items()}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _fmt(values: list[Optional[float]]) -> str:
    cells = " ".join("-" if v is None else f"{v:.2f}" for v in values)
    done = [v for v in values if v is not None]
    mean = f"{statistics.mean(done):.2f}" if len(done) == len(values) else "-"
    return f"{cells} (mean {mean})"


def verdict(results: list[dict[str, Any]], setting: Optional[str] = None, off: Optional[str] = None,
            plain: Optional[str] = None) -> str:
    """The per-method table and the acceptance lines (module docstring)."""
    seeds = [seed_times(r) for r in results]
    methods = list(seeds[0][1])
    lines = ["targets (AdamW's final loss per seed): " + " ".join(f"{t:.4f}" for t, _ in seeds), "",
             "| method | × AdamW's time, per seed (mean) | × Muon's time, per seed (mean) |", "|---|---|---|"]
    for m in methods:
        to_adamw = [_ratio(ts.get(m), ts["adamw"]) for _, ts in seeds]
        to_muon = [_ratio(ts.get(m), ts.get("muon")) for _, ts in seeds]
        lines.append(f"| {m} | {_fmt(to_adamw)} | {_fmt(to_muon)} |")
    if setting and off:
        lines += ["", f"curvature off ({off}) / on ({setting}), time to the target: "
                  + _fmt([_ratio(ts.get(off), ts.get(setting)) for _, ts in seeds])]
    if plain:
        lines += [f"without the polar factor ({plain}), × AdamW's time: "
                  + _fmt([_ratio(ts.get(plain), ts["adamw"]) for _, ts in seeds])]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="directories of tools.peer_bench results, one seed each "
                    "(--protocol: tools.lm_protocol results trees)")
    ap.add_argument("--protocol", action="store_true", help="the protocol table of tools.lm_protocol trees")
    ap.add_argument("--setting", default=None, help="the TENGraD setting raced")
    ap.add_argument("--off", default=None, help="its twin with the curvature switched off")
    ap.add_argument("--plain", default=None, help="a TENGraD setting without the polar factor")
    a = ap.parse_args(argv)
    if a.protocol:
        text = "\n\n".join(table(name, model, aggregate(model)) for name, model in load(a.runs).items())
        print(text)
        return text
    results = [json.loads((Path(d) / "results.json").read_text()) for d in a.runs]
    text = verdict(results, a.setting, a.off, a.plain)
    print(text)
    return text


if __name__ == "__main__":
    main()
