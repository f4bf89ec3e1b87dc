"""The benchmark protocol of Wen et al. (2025), "Fantastic pretraining optimizers and where to
find them", on the byte-level language models, driving ``tools.peer_bench``.

    python -m tools.lm_protocol --model gpt2-bytes-s --budget 150 --methods adamw,muon-torch,soap \\
        --tengrad 'lm:preset=lm' [--tengrad ...] --seeds 0,1,2 --out runs/proto-gpt2-s
        [--points 5] [--lr-grid-for 'adamw=1e-3:3' ...] [--multiples 1,2,4] [--warmup-frac 0.1]
        [--no-twins] [--text PATH] [--batch-size 32] [--eval-subset 256] [--eval-every N]
        [--warmup 2] [--device cpu|cuda] [--threads N] [--verbose]
    python -m tools.lm_verdict --protocol runs/proto-gpt2-s [runs/proto-gpt2-s-extra ...]

* Methods: ``--methods`` (``tools.peer_methods.METHODS``; AdamW is the reference and must be in
  the trees the verdict reads) and every ``--tengrad NAME:key=value,...`` setting with its
  curvature-off twin ``NAME-off`` (the same options and ``damping=1000``; ``--no-twins``: none).
* Lr grids: each method ``--points`` lrs (odd, default 5) a factor 2 apart centred on its
  default lr (default × {1/4, 1/2, 1, 2, 4}); ``--lr-grid-for NAME=CENTRE:K`` (K points ×2
  apart) or ``NAME=LR,LR,...`` gives one method its own, and a twin its setting's unless
  named itself (at ``-m``: the ``-s`` best lrs, which ``tools.lm_verdict --protocol`` prints
  as these options, with ``--seeds 0``).
* Schedule: a linear warm-up over ``round(warmup_frac × budget)`` steps, then a cosine to 0
  at the budget's end (``tools.lr_grid.lr_multiplier``); each budget is its own run.
* Budgets: ``B`` = ``--budget`` steps times ``--multiples`` (default 1, 2, 4); AdamW runs
  every multiple, the other methods those up to 2 (B and 2B).
* Per (budget, seed) one ``tools.peer_bench`` race: every method at every lr of its grid in
  lockstep on the same batches from the same initial weights (``--seed``), SGD at its
  default lr beside them as the step-time reference; the validation loss at the end
  (``--eval-every``, default the budget: only there). Its ``--out`` is ``OUT/bBUDGET/seedS``;
  a race whose ``results.json`` is there already is not run again (a stopped protocol
  resumes). ``OUT/protocol.json`` holds the plan: model, budgets, methods, grids, seeds.

``tools.lm_verdict --protocol`` (:mod:`tools.protocol_table`) then gives per method the best
lr per budget (flagged at the grid's edge, with the next lr to run), the final loss at each
budget over the seeds, and the speedup over AdamW per step and in time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from tools import peer_bench
from tools.lm_workloads import LM_MODELS
from tools.lr_grid import lr_grid, parse_lr_grid
from tools.peer_methods import METHODS, PEERS, parse_variant, peer_library, tengrad_method

__all__ = ["CURVATURE_OFF", "budgets_of", "main", "method_grids", "race_argv", "twins"]

CURVATURE_OFF = 1000.0
"""The damping of a setting's curvature-off twin."""

LR_STEP = 2.0
"""The ratio of neighbouring lrs of the protocol's grids."""


def twins(specs: list[str]) -> list[str]:
    """Each ``--tengrad`` setting ``NAME:k=v,...`` followed by ``NAME-off``: the same with ``damping=1000``."""
    out = []
    for spec in specs:
        name, opts = parse_variant(spec)
        off = {**opts, "damping": CURVATURE_OFF}
        out += [spec, f"{name}-off:" + ",".join(f"{k}={v}" for k, v in off.items())]
    return out


def method_grids(methods: list[str], tengrad: list[str], points: int, given: list[str]) -> dict[str, list[float]]:
    """Each method's lrs: ``points`` lrs ×2 apart centred on its default, or its ``given`` grid (a
    twin ``NAME-off`` not given one takes ``NAME``'s)."""
    defaults = {m: METHODS[m].lr for m in methods}
    defaults |= {n: tengrad_method(n, o).lr for n, o in map(parse_variant, tengrad)}
    grids = dict(parse_lr_grid(s, LR_STEP) for s in given)
    unknown = set(grids) - set(defaults)
    if unknown:
        raise ValueError(f"--lr-grid-for names {sorted(unknown)}, which the protocol does not run: {sorted(defaults)}")
    for m in defaults:
        if m not in grids and m.endswith("-off") and m[:-4] in grids:
            grids[m] = grids[m[:-4]]
    return {m: grids.get(m) or lr_grid(lr, points, LR_STEP) for m, lr in defaults.items()}


def budgets_of(budget: int, multiples: list[int], method: str) -> list[int]:
    """The budgets (steps) ``method`` runs: AdamW every multiple of ``budget``, the others those ≤ 2."""
    return [budget * k for k in multiples if method == "adamw" or k <= 2]


def race_argv(a: argparse.Namespace, steps: int, seed: int, methods: list[str], tengrad: list[str],
              grids: dict[str, list[float]]) -> list[str]:
    """The ``tools.peer_bench`` command line of one (budget, seed) race of ``methods`` and ``tengrad``."""
    names = methods + [parse_variant(s)[0] for s in tengrad]
    argv = ["--model", a.model, "--methods", ",".join(["sgd"] + [m for m in methods if m != "sgd"]),
            "--steps", str(steps), "--seed", str(seed), "--schedule", "cosine",
            "--lr-warmup", str(round(a.warmup_frac * steps)), "--lr-step", str(LR_STEP),
            "--eval-every", str(a.eval_every or steps), "--warmup", str(a.warmup), "--device", a.device]
    argv += [x for s in tengrad for x in ("--tengrad", s)]
    argv += [x for n in names for x in ("--lr-grid-for", f"{n}=" + ",".join(map(repr, grids[n])))]
    if "sgd" not in methods:
        argv += ["--lr-grid-for", f"sgd={METHODS['sgd'].lr!r}"]
    for opt in ("text", "batch_size", "eval_subset", "threads"):
        if getattr(a, opt) is not None:
            argv += [f"--{opt.replace('_', '-')}", str(getattr(a, opt))]
    return argv + (["--verbose"] if a.verbose else [])


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, choices=LM_MODELS)
    ap.add_argument("--budget", type=int, required=True, help="B: the smallest budget, in steps")
    ap.add_argument("--methods", default="adamw", help=f"comma list of {sorted(METHODS)} (AdamW: the reference)")
    ap.add_argument("--tengrad", action="append", default=[],
                    help="a TENGraD setting 'NAME:key=value,...' (repeatable)")
    ap.add_argument("--no-twins", action="store_true", help="no curvature-off twin (damping 1000) of each --tengrad")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--points", type=int, default=5, help="lrs per method, ×2 apart, centred on its default (odd)")
    ap.add_argument("--lr-grid-for", action="append", default=[],
                    help="one method's lrs: NAME=CENTRE:K (K points ×2 apart) or NAME=LR,LR,... (repeatable)")
    ap.add_argument("--multiples", default="1,2,4", help="budgets as multiples of B (the others than AdamW: ≤ 2)")
    ap.add_argument("--warmup-frac", type=float, default=0.1, help="linear lr warm-up, a fraction of each budget")
    ap.add_argument("--eval-every", type=int, default=None, help="default: the budget (the final loss only)")
    ap.add_argument("--warmup", type=int, default=2, help="timing rounds left out of the step-cost ratios")
    for opt in ("--text", "--device", "--batch-size", "--eval-subset", "--threads"):
        ap.add_argument(opt, default="cpu" if opt == "--device" else None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    a.methods = [m for m in a.methods.split(",") if m]
    unknown = [m for m in a.methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; choose from {sorted(METHODS)}")
    if not 0 <= a.warmup_frac < 1:
        ap.error(f"--warmup-frac must be in [0, 1), got {a.warmup_frac}")
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.multiples = [int(k) for k in a.multiples.split(",")]
    a.tengrad = a.tengrad if a.no_twins else twins(a.tengrad)
    names = a.methods + [parse_variant(s)[0] for s in a.tengrad]
    if len(set(names)) < len(names):
        ap.error(f"the methods and --tengrad settings (with their twins NAME-off) must have distinct names: {names}")
    if a.budget < 1 or min(a.multiples) < 1:
        ap.error(f"--budget and --multiples must be positive, got {a.budget} and {a.multiples}")
    return a


def plan(a: argparse.Namespace, grids: dict[str, list[float]]) -> dict[str, Any]:
    """``protocol.json``: the model, B, each method's budgets and grid, the seeds, and each
    method's own options of this driver (to run extra lr points of it later)."""
    alone = ["--methods", "", "--no-twins"]  # a setting rerun without AdamW or its twin
    own = {m: ["--methods", m] for m in a.methods} | {parse_variant(s)[0]: [*alone, "--tengrad", s] for s in a.tengrad}
    base = ["--model", a.model, "--budget", str(a.budget), "--seeds", ",".join(map(str, a.seeds)),
            "--warmup-frac", str(a.warmup_frac)]
    for opt in ("text", "device", "batch_size", "eval_subset", "eval_every"):
        if getattr(a, opt) is not None:
            base += [f"--{opt.replace('_', '-')}", str(getattr(a, opt))]
    return {"model": a.model, "budget": a.budget, "methods": list(own), "seeds": a.seeds, "grids": grids,
            "budgets": {m: budgets_of(a.budget, a.multiples, m) for m in own}, "warmup_frac": a.warmup_frac,
            "base_args": base, "method_args": own}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    a = parse_args(argv)
    if any(m in PEERS for m in a.methods):
        peer_library()
    grids = method_grids(a.methods, a.tengrad, a.points, a.lr_grid_for)
    spec = plan(a, grids)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "protocol.json").write_text(json.dumps(spec, indent=2))
    for steps in sorted({b for bs in spec["budgets"].values() for b in bs}):
        methods = [m for m in a.methods if steps in spec["budgets"][m]]
        tengrad = [s for s in a.tengrad if steps in spec["budgets"][parse_variant(s)[0]]]
        for seed in a.seeds:
            where = out / f"b{steps}" / f"seed{seed}"
            if (where / "results.json").exists():
                print(f"budget {steps}, seed {seed}: {where}/results.json is there, not run again")
                continue
            print(f"budget {steps}, seed {seed}: " + ", ".join(methods + [parse_variant(s)[0] for s in tengrad]),
                  flush=True)
            res = peer_bench.train(peer_bench.parse_args(race_argv(a, steps, seed, methods, tengrad, grids)))
            peer_bench.write_outputs(res, str(where), plot=False)
    return spec


if __name__ == "__main__":
    main()
