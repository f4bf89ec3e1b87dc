"""The language-model protocol's table (``python -m tools.lm_verdict --protocol OUT [OUT ...]``)
from the results trees of :mod:`tools.lm_protocol`.

Per model, per method and budget (``B``, ``2B``; AdamW also ``4B``), over the seeds:

* the best lr: the lr of the grid with the lowest mean final validation loss over the seeds
  every lr of the grid ran (a seed whose loss is not finite counts as +∞: at ``-m``, a
  3-point grid on seed 0 and the other seeds at its best lr compare on seed 0); flagged
  when it is the grid's lowest or highest point (:func:`edge`), with the lr to run next:
  one grid step beyond it;
* the final loss at the best lr: mean ± half the min–max range over the seeds;
* the step cost: the mean of its ``ratio_to_sgd`` at the best lr (each measured in its own
  interleaved run), over AdamW's in the same runs;
* the speedup (:func:`speedup`): the AdamW budget that reaches the method's mean final
  loss, interpolated on AdamW's curve (its mean final loss at its best lr against the
  budget: piecewise linear in the loss against log budget, the first crossing), divided by
  the method's budget: per step, and in time (× AdamW's step cost over the method's). Below
  AdamW's loss at its largest budget the speedup is a lower bound (``>4x`` at ``B``); above
  its loss at ``B``, an upper bound (``<1x`` at ``B``): no extrapolation.

Several trees of the same model merge (extra lr points run later, :func:`load`); a
(method, budget, seed, lr) run twice is refused.
"""
from __future__ import annotations

import json
import math
import shlex
import statistics
from pathlib import Path
from typing import Any, Optional

from tools.peer_seeds import _spread

__all__ = ["adamw_budget", "aggregate", "edge", "load", "next_size", "speedup", "table"]


def adamw_budget(budgets: list[float], losses: list[float], loss: float) -> tuple[float, str]:
    """(budget, relation) at which AdamW's curve (``losses`` at ascending ``budgets``) reaches
    ``loss``: ``"="`` interpolated (log budget linear in the loss, on the first segment that
    crosses it), ``"<"`` below ``budgets[0]`` (AdamW's first loss is already lower), ``">"``
    beyond ``budgets[-1]`` (never reached); ``loss`` must be finite."""
    if not math.isfinite(loss):
        raise ValueError(f"adamw_budget: the loss {loss} is not finite (a diverged run has no speedup)")
    if losses[0] <= loss:
        return budgets[0], "=" if losses[0] == loss else "<"
    for (b0, l0), (b1, l1) in zip(zip(budgets, losses), zip(budgets[1:], losses[1:])):
        if l0 > loss >= l1:
            frac = (l0 - loss) / (l0 - l1)
            return math.exp(math.log(b0) + frac * (math.log(b1) - math.log(b0))), "="
    return budgets[-1], ">"


def speedup(budgets: list[float], losses: list[float], loss: float, budget: float) -> tuple[float, str]:
    """(AdamW's budget to ``loss`` / ``budget``, relation of :func:`adamw_budget`)."""
    b, rel = adamw_budget(budgets, losses, loss)
    return b / budget, rel


def edge(lrs: list[float], best: float) -> Optional[dict[str, Any]]:
    """None when ``best`` is inside the ascending grid ``lrs``; else ``{"side": "low" | "high" |
    "single", "next": [lrs to run]}``: one grid step (the ratio of the two outer points; 2 for a
    one-point grid) below the lowest or above the highest."""
    if len(lrs) < 2:
        return {"side": "single", "next": [float(f"{best / 2:.6g}"), float(f"{best * 2:.6g}")]}
    if best == lrs[0]:
        return {"side": "low", "next": [float(f"{lrs[0] ** 2 / lrs[1]:.6g}")]}
    if best == lrs[-1]:
        return {"side": "high", "next": [float(f"{lrs[-1] ** 2 / lrs[-2]:.6g}")]}
    return None


def load(dirs: list[str]) -> dict[str, dict[str, Any]]:
    """Per model: ``{"budget": B, "methods": [...], "rows": [...], "dirs": [...]}`` from the trees
    ``dirs`` (``protocol.json`` and ``*/*/results.json``); a row per (method, budget, seed, lr)."""
    out: dict[str, dict[str, Any]] = {}
    for d in dirs:
        spec = json.loads((Path(d) / "protocol.json").read_text())
        model = out.setdefault(spec["model"], {"budget": spec["budget"], "methods": [], "rows": [], "dirs": [],
                                               "base_args": spec["base_args"], "method_args": {}})
        if model["budget"] != spec["budget"]:
            raise ValueError(f"{d}: budget {spec['budget']}, another tree of {spec['model']} has "
                             f"{model['budget']}: merge trees of one --budget only")
        model["methods"] += [m for m in spec["methods"] if m not in model["methods"]]
        model["method_args"] |= spec["method_args"]
        model["dirs"].append(d)
        seen = {(r["method"], r["budget"], r["seed"], r["lr"]) for r in model["rows"]}
        for f in sorted(Path(d).glob("*/*/results.json")):
            res = json.loads(f.read_text())
            for run in res["runs"]:
                if run["method"] not in spec["methods"]:
                    continue  # the timing reference
                key = (run["method"], res["config"]["steps"], res["config"]["seed"], run["lr"])
                if key in seen:
                    raise ValueError(f"{f}: {key[0]} at budget {key[1]}, seed {key[2]}, lr {key[3]} is also in "
                                     "another tree: give each run once")
                seen.add(key)
                model["rows"].append(dict(zip(("method", "budget", "seed", "lr"), key), loss=run["final_loss"],
                                          cost=run["ratio_to_sgd"]))
    return out


def _best(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The best lr of one method's rows at one budget (by the mean over the seeds every lr ran),
    its losses over all its seeds, cost and edge flag."""
    lrs = sorted({r["lr"] for r in rows})
    at = {lr: [r for r in rows if r["lr"] == lr] for lr in lrs}
    common = set.intersection(*({r["seed"] for r in at[lr]} for lr in lrs))
    score = {lr: statistics.fmean(r["loss"] if math.isfinite(r["loss"]) else math.inf
                                  for r in at[lr] if r["seed"] in common) for lr in lrs}
    best = min(lrs, key=lambda lr: score[lr])
    losses = [r["loss"] for r in at[best]]
    mean, half = _spread(losses) if all(map(math.isfinite, losses)) else (math.inf, math.nan)
    return {"lr": best, "grid": lrs, "edge": edge(lrs, best), "loss": mean, "spread": half, "seeds": len(losses),
            "cost": statistics.fmean(r["cost"] for r in at[best])}


def aggregate(model: dict[str, Any]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per method, per budget: :func:`_best`'s entry, and (AdamW in the trees) ``speedup_step``,
    ``speedup_time`` as (value, relation)."""
    rows = model["rows"]
    out = {m: {b: _best([r for r in rows if r["method"] == m and r["budget"] == b])
               for b in sorted({r["budget"] for r in rows if r["method"] == m})}
           for m in model["methods"] if any(r["method"] == m for r in rows)}
    if "adamw" not in out:
        raise ValueError("tools.lm_verdict --protocol: the trees hold no 'adamw' runs (the speedups' reference)")
    curve = out["adamw"]
    budgets = [b for b in curve if math.isfinite(curve[b]["loss"])]
    for per_budget in out.values():
        for b, e in per_budget.items():
            e["cost_to_adamw"] = e["cost"] / curve[b]["cost"] if b in curve else None
            if not budgets or not math.isfinite(e["loss"]):
                e["speedup_step"] = e["speedup_time"] = None
                continue
            s, rel = speedup([float(x) for x in budgets], [curve[x]["loss"] for x in budgets], e["loss"], b)
            e["speedup_step"] = (s, rel)
            e["speedup_time"] = None if e["cost_to_adamw"] is None else (s / e["cost_to_adamw"], rel)
    return out


def _x(s: Optional[tuple[float, str]]) -> str:
    return "–" if s is None else f"{'' if s[1] == '=' else s[1]}{s[0]:.3g}x"


def _lr(e: dict[str, Any]) -> str:
    return f"{e['lr']:.3g}" + ("" if e["edge"] is None else f" ({e['edge']['side']} edge)")


def table(name: str, model: dict[str, Any], agg: dict[str, dict[int, dict[str, Any]]]) -> str:
    """The protocol table of one model, the edge lines and the lrs for the next size."""
    B = model["budget"]
    budgets = sorted({b for per in agg.values() for b in per})
    tag = {b: f"{b // B}B" if b % B == 0 else str(b) for b in budgets}
    n = max(e["seeds"] for per in agg.values() for e in per.values())
    lines = [f"{name}: B = {B} steps; " + ", ".join(f"{tag[b]} = {b}" for b in budgets) + f"; {n} seed(s)", "",
             "| method | best lr (" + " / ".join(tag[b] for b in budgets) + ") | "
             + " | ".join(f"loss at {tag[b]}" for b in budgets) + " | speedup per step | speedup in time | "
             "step cost × AdamW |", "|" + "---|" * (len(budgets) + 5)]
    for m, per in agg.items():
        cell = {b: per.get(b) for b in budgets}
        own = [b for b in budgets if b in per]
        loss = ["–" if e is None else ("diverged" if not math.isfinite(e["loss"]) else
                                       f"{e['loss']:.4f} ± {e['spread']:.4f}")
                + ("" if e["seeds"] == n else f" ({e['seeds']} of {n})") for e in cell.values()]
        step = " / ".join(f"{_x(per[b]['speedup_step'])} at {tag[b]}" for b in own)
        time = " / ".join(f"{_x(per[b]['speedup_time'])} at {tag[b]}" for b in own)
        cost = " / ".join("–" if per[b].get("cost_to_adamw") is None else f"{per[b]['cost_to_adamw']:.2f}"
                          for b in own)
        lines.append(f"| {m} | " + " / ".join("–" if e is None else _lr(e) for e in cell.values())
                     + " | " + " | ".join(loss) + f" | {step} | {time} | {cost} |")
    lines += ["", "loss: final validation loss (nats/byte) at the best lr, mean ± half the min–max range over the "
              "seeds; speedup: AdamW's budget to that mean loss (log-budget interpolation on AdamW's curve) over "
              "the method's budget, in time × AdamW's step cost over the method's; > / <: beyond AdamW's "
              "largest / below its smallest budget."]
    edges: dict[tuple[str, tuple[float, ...]], list[int]] = {}
    for m, per in agg.items():
        for b, e in per.items():
            if e["edge"]:
                edges.setdefault((m, tuple(e["edge"]["next"])), []).append(b)
    for (m, nxt), bs in edges.items():
        run = ["python", "-m", "tools.lm_protocol", *model["base_args"], *model["method_args"][m],
               "--lr-grid-for", f"{m}=" + ",".join(f"{x:g}" for x in nxt),
               "--multiples", ",".join(str(b // B) for b in bs), "--out", f"{model['dirs'][0]}-extra"]
        where = "; ".join(f"{per_b['lr']:g} the {per_b['edge']['side']} point of "
                          f"{[float(f'{x:.3g}') for x in per_b['grid']]} at {tag[b]}"
                          for b in bs for per_b in [agg[m][b]])
        lines.append(f"edge: {m}: best lr {where}; run the next: {shlex.join(run)} "
                     "(then give both trees to tools.lm_verdict --protocol)")
    lines += ["", "lrs for the next size (a 3-point check on seed 0): " + next_size(agg, B)]
    return "\n".join(lines)


def next_size(agg: dict[str, dict[int, dict[str, Any]]], budget: int) -> str:
    """``--lr-grid-for`` options centring each method's 3-point grid on its best lr at ``budget``."""
    return " ".join(f"--lr-grid-for '{m}={per[budget]['lr']:g}:3'" for m, per in agg.items() if budget in per)
