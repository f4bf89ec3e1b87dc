"""Two versions of the code, the same ``tools.bench`` run, interleaved: are the ratios to SGD unchanged?

    python -m tools.ab_bench --before REF [--after REF|.] [--rounds 3] -- BENCH ARGS...
    python -m tools.ab_bench --before b188c81 --rounds 3 -- --model tiny --methods paper --steps 60 --warmup 3

Each version's ``python -m tools.bench BENCH ARGS --json`` runs in a subprocess from its
own checkout (``--before`` is checked out into a temporary git worktree; ``--after`` is
this checkout by default), alternating before, after, before, after, ... for ``--rounds``
rounds, so the machine's drift over the run hits both alike. Within each run the bench
times every method interleaved with SGD; this tool prints, per method, each version's
median ratio to SGD over the rounds and ``after / before``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def checkout(ref: str, where: Path) -> Path:
    """``ref`` as a detached git worktree under ``where`` (``.`` is this checkout itself)."""
    if ref == ".":
        return ROOT
    path = where / ref.replace("/", "_")
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(path), ref],
                   check=True, capture_output=True)
    return path


def bench_ratios(tree: Path, bench_args: list[str], out: Path) -> dict[str, float]:
    """``{method: ratio to SGD}`` of one ``tools.bench`` run from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "tools.bench", *bench_args, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    res: dict[str, Any] = json.loads(out.read_text())["results"]
    return {meth: float(r["ratio_to_sgd"]) for meth, r in res.items()}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="git ref of the baseline version")
    ap.add_argument("--after", default=".", help="git ref of the new version ('.': this checkout)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    runs: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": checkout(args.before, Path(tmp)), "after": checkout(args.after, Path(tmp))}
        try:
            for r in range(args.rounds):
                for which, tree in trees.items():
                    ratios = bench_ratios(tree, bench_args, Path(tmp) / f"{which}{r}.json")
                    for meth, x in ratios.items():
                        runs[which].setdefault(meth, []).append(x)
                    print(f"round {r} {which}: " + ", ".join(f"{m} {x:.3f}" for m, x in ratios.items()), flush=True)
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                   capture_output=True)
    print(f"\nratio to SGD, median of {args.rounds} alternating runs: before {args.before}, after {args.after}")
    print(f"{'method':<24}{'before':>9}{'after':>9}{'after/before':>14}")
    for meth, xs in runs["before"].items():
        b, a = statistics.median(xs), statistics.median(runs["after"].get(meth, [float("nan")]))
        print(f"{meth:<24}{b:>9.3f}{a:>9.3f}{a / b:>14.3f}")


if __name__ == "__main__":
    main()
