"""Grid search over the paper's hyperparameter grids, resumable, and its Table-2 summary.

Run a sweep (every grid point × seed is one ``python -m tengrad_fx.cli.train`` subprocess)::

    python -m tools.sweep --optimizer tengrad --model 3c1f --dataset fashion-mnist \\
        --lr 0.001,0.003 --weight-decay 0.001 --damping 0.1 --seeds 0,1 --epochs 1 \\
        [--subset N] [--max-steps N] [--batch-size B] [--jobs 1] [--target-acc 0.86] \\
        --out DIR [-- EXTRA TRAIN ARGS]

Summarize one or more sweep directories (or any folders of run directories)::

    python -m tools.sweep summarize DIR... [--target-acc 0.86]

Grids (comma-separated; the defaults are the paper's): ``--lr`` 0.001,0.003,0.01,0.03,
0.1,0.3; ``--weight-decay`` 0.001,0.003,0.01,0.03,0.1,0.3; ``--damping`` 0.001,0.003,
0.01,0.03,0.1,0.2,0.3 (not used for ``sgd``). Seeds default to ``0``.

Layout of ``DIR``: ``runs/<optimizer>-lr<lr>-wd<wd>[-d<damping>]-s<seed>/`` (one run
directory each, see ``tengrad_fx/cli/_runs.py``), ``logs/<same name>.log`` (the run's stdout and
stderr), ``sweep.json`` (the last invocation's arguments) and ``results.csv``.

Resumable and parallel-safe: a point whose ``summary.json`` exists is skipped; a point
being trained by another sweep process holds ``runs/<name>.lock`` (with that process's
pid; a lock of a dead process is taken over) and is skipped too. ``results.csv`` is
regenerated from all finished run directories at the end and written atomically
(temporary file + ``os.replace``), so concurrent sweeps into one directory never leave a
torn file. Columns: optimizer, lr, weight_decay, damping, seed, test_acc, train_time,
time_to_target, then train_acc, test_loss, epochs, steps, model, dataset, run.

``summarize`` picks, per method (model, dataset, optimizer), the grid point (every config
value but the seed) with the best mean test accuracy over its seeds and prints the
paper's Table 2 format ``time (s) [test acc %]`` as mean ± std over seeds (sample std);
with ``--target-acc`` also the training time until the first end-of-epoch evaluation
with test accuracy ≥ target (over the seeds that reached it; ``k/n`` reached).
Accuracies may be given as fractions (0.86) or percentages (86).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import io
import itertools
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from tengrad_fx.cli._runs import Run, atomic_write_text, config_key, find_runs, frac, mean_std, time_to_target

__all__ = ["PAPER_GRID", "DAMPED", "CSV_COLUMNS", "GridPoint", "grid_points", "point_name", "train_command",
           "run_train", "run_sweep", "results_rows", "write_results", "read_results", "summarize",
           "format_table", "main"]

PAPER_GRID = {
    "lr": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3],
    "weight_decay": [0.001, 0.003, 0.01, 0.03, 0.1, 0.3],
    "damping": [0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3],
}
DAMPED = ("tengrad", "kfac", "ekfac", "kbfgs")
"""Optimizers that take ``--damping`` (the grid has no damping axis for the others)."""

CSV_COLUMNS = ["optimizer", "lr", "weight_decay", "damping", "seed", "test_acc", "train_time", "time_to_target",
               "train_acc", "test_loss", "epochs", "steps", "model", "dataset", "run"]

GridPoint = tuple[float, float, Optional[float]]  # (lr, weight_decay, damping)


def _floats(text: Optional[str], default: list[float]) -> list[float]:
    if text is None:
        return list(default)
    return [float(v) for v in text.split(",") if v.strip()]


def grid_points(optimizer: str, lrs: Sequence[float], wds: Sequence[float],
                dampings: Sequence[float]) -> list[GridPoint]:
    """The grid (lr × weight decay × damping; no damping axis for undamped optimizers)."""
    ds: Sequence[Optional[float]] = list(dampings) if optimizer in DAMPED else [None]
    return [(lr, wd, d) for lr, wd, d in itertools.product(lrs, wds, ds)]


def point_name(optimizer: str, point: GridPoint, seed: int) -> str:
    """Run directory name of one grid point and seed, e.g. ``tengrad-lr0.003-wd0.001-d0.1-s0``."""
    lr, wd, d = point
    name = f"{optimizer}-lr{lr:g}-wd{wd:g}"
    if d is not None:
        name += f"-d{d:g}"
    return f"{name}-s{seed}"


def _train_has_flag(flag: str) -> bool:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
    try:
        with open(path) as f:
            return flag in f.read()
    except OSError:
        return False


def train_command(args: argparse.Namespace, point: GridPoint, seed: int, out: str,
                  threads: Optional[int] = None) -> list[str]:
    """The ``python -m tengrad_fx.cli.train`` command line of one grid point and seed."""
    lr, wd, d = point
    cmd = [sys.executable, "-m", "tengrad_fx.cli.train", "--model", args.model, "--dataset", args.dataset,
           "--optimizer", args.optimizer, "--epochs", str(args.epochs), "--lr", repr(lr),
           "--weight-decay", repr(wd), "--seed", str(seed), "--out", out, "--no-progress"]
    if d is not None:
        cmd += ["--damping", repr(d)]
    for flag, val in (("--batch-size", args.batch_size), ("--subset", args.subset),
                      ("--max-steps", args.max_steps), ("--threads", threads)):
        if val is not None:
            cmd += [flag, str(val)]
    if _train_has_flag("--no-plot") and "--plot" not in args.extra:
        cmd.append("--no-plot")  # the per-run curves cost seconds per run; tengrad_fx.cli.plot draws them later
    return cmd + [a for a in args.extra if a != "--plot"]


def run_train(cmd: list[str], log_path: str, cwd: Optional[str] = None) -> int:
    """Run one training subprocess, stdout and stderr to ``log_path``; its exit status."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        return subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _acquire(lock: str) -> bool:
    """Take the point's lock file (``O_EXCL``); take over a lock whose process is dead."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(lock) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _pid_alive(pid):
                return False
            try:
                os.unlink(lock)  # left over (its process is gone)
            except FileNotFoundError:
                pass
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_sweep(args: argparse.Namespace, runner: Optional[Callable[[list[str], str], int]] = None) -> dict[str, Any]:
    """Run every missing grid point × seed; regenerate ``results.csv``. Returns counts and
    the CSV path. ``runner(cmd, log_path) -> exit status`` defaults to :func:`run_train`."""
    runner = runner or (lambda cmd, log: run_train(cmd, log, cwd=_repo_root()))
    out = os.path.abspath(args.out)
    runs_dir, logs_dir = os.path.join(out, "runs"), os.path.join(out, "logs")
    os.makedirs(runs_dir, exist_ok=True)
    points = grid_points(args.optimizer, args.lr, args.weight_decay, args.damping)
    jobs = max(1, args.jobs)
    threads = args.threads if args.threads is not None else max(1, (os.cpu_count() or 1) // jobs)
    meta = {k: v for k, v in vars(args).items() if k not in ("func",)}
    atomic_write_text(os.path.join(out, "sweep.json"), json.dumps(meta, indent=2, default=str) + "\n")

    todo, skipped = [], 0
    for point, seed in itertools.product(points, args.seeds):
        name = point_name(args.optimizer, point, seed)
        if os.path.exists(os.path.join(runs_dir, name, "summary.json")):
            skipped += 1
        else:
            todo.append((point, seed, name))
    print(f"sweep {args.optimizer}: {len(points)} grid points × {len(args.seeds)} seeds = "
          f"{len(points) * len(args.seeds)} runs; {skipped} done already, {len(todo)} to run, {jobs} at a time",
          flush=True)

    def one(item: tuple[GridPoint, int, str]) -> tuple[str, str]:
        point, seed, name = item
        run_dir = os.path.join(runs_dir, name)
        lock = os.path.join(runs_dir, name + ".lock")
        if not _acquire(lock):
            return name, "busy"
        try:
            if os.path.exists(os.path.join(run_dir, "summary.json")):  # finished meanwhile
                return name, "skipped"
            cmd = train_command(args, point, seed, run_dir, threads)
            if args.dry_run:
                print(" ".join(cmd))
                return name, "dry-run"
            t0 = time.perf_counter()
            rc = runner(cmd, os.path.join(logs_dir, name + ".log"))
            ok = rc == 0 and os.path.exists(os.path.join(run_dir, "summary.json"))
            print(f"  {name}: {'ok' if ok else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.1f} s", flush=True)
            return name, "ok" if ok else "failed"
        finally:
            try:
                os.unlink(lock)
            except FileNotFoundError:
                pass

    results: list[tuple[str, str]] = []
    if jobs == 1:
        results = [one(item) for item in todo]
    else:
        with cf.ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(one, todo))
    failed = [n for n, s in results if s == "failed"]
    for n in failed:
        print(f"failed: {n} (log: {os.path.join(logs_dir, n + '.log')})", file=sys.stderr)
    busy = [n for n, s in results if s == "busy"]
    if busy:
        print(f"{len(busy)} points are being trained by another sweep process: {', '.join(busy)}")
    path = write_results(out, args.target_acc)
    print(f"results: {path}")
    return {"ran": sum(s == "ok" for _, s in results), "skipped": skipped + sum(s == "skipped" for _, s in results),
            "failed": failed, "busy": busy, "csv": path}


# --------------------------------------------------------------------------- results


def _num(v: Any) -> Any:
    return "" if v is None else v


def results_rows(dirs: Sequence[str], target_acc: Optional[float] = None) -> list[dict[str, Any]]:
    """One CSV row per finished run at or below ``dirs``."""
    rows = []
    for r in find_runs(dirs):
        s = r.summary or {}
        last = r.epochs[-1] if r.epochs else {}
        train_acc = s.get("train_acc", last.get("train_acc"))
        ttt = time_to_target(r, target_acc) if target_acc is not None else None
        rows.append({
            "optimizer": r.get("optimizer"), "lr": r.get("lr"), "weight_decay": r.get("weight_decay"),
            "damping": r.get("damping") if r.get("optimizer") in DAMPED else None,
            "seed": r.get("seed"), "test_acc": frac(s.get("test_acc")), "train_time": s.get("train_time"),
            "time_to_target": ttt, "train_acc": frac(train_acc), "test_loss": s.get("test_loss"),
            "epochs": s.get("epochs"), "steps": s.get("steps"), "model": r.get("model"),
            "dataset": r.get("dataset"), "run": os.path.relpath(r.path, dirs[0]) if len(dirs) == 1 else r.path,
        })
    rows.sort(key=lambda x: tuple(str(x[k]) for k in ("optimizer", "model", "dataset")) +
              tuple(_sortable(x[k]) for k in ("lr", "weight_decay", "damping", "seed")))
    return rows


def _sortable(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return -math.inf


def write_results(sweep_dir: str, target_acc: Optional[float] = None) -> str:
    """Regenerate ``sweep_dir/results.csv`` from its finished runs, atomically."""
    if target_acc is None:
        try:
            with open(os.path.join(sweep_dir, "sweep.json")) as f:
                target_acc = json.load(f).get("target_acc")
        except (OSError, ValueError):
            pass
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for row in results_rows([sweep_dir], target_acc):
        w.writerow({k: _num(row[k]) for k in CSV_COLUMNS})
    path = os.path.join(sweep_dir, "results.csv")
    atomic_write_text(path, buf.getvalue())
    return path


def read_results(path: str) -> list[dict[str, Any]]:
    """``results.csv`` rows with numbers parsed (empty cells → ``None``)."""
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            parsed: dict[str, Any] = {}
            for k, v in row.items():
                if v == "" or v is None:
                    parsed[k] = None
                elif k in ("optimizer", "model", "dataset", "run"):
                    parsed[k] = v
                else:
                    try:
                        parsed[k] = float(v)
                    except ValueError:
                        parsed[k] = v
            out.append(parsed)
    return out


# --------------------------------------------------------------------------- summary


def summarize(dirs: Sequence[str], target_acc: Optional[float] = None) -> list[dict[str, Any]]:
    """Best grid point per method (model, dataset, optimizer) by mean test accuracy.

    Each entry: ``method``, ``model``, ``dataset``, ``point`` (config values defining the
    grid point: lr, weight_decay, damping, ...), ``seeds``, ``n``, ``time_mean``,
    ``time_std``, ``acc_mean``, ``acc_std`` (percent), ``ttt_mean``, ``ttt_std``,
    ``ttt_reached`` (with a target), ``n_points`` (grid points tried).
    """
    runs = find_runs(dirs)
    methods: dict[tuple, dict[tuple, list[Run]]] = {}
    for r in runs:
        mkey = (r.get("model"), r.get("dataset"), r.get("optimizer"))
        methods.setdefault(mkey, {}).setdefault(config_key(r), []).append(r)
    out = []
    for (model, dataset, opt), points in methods.items():
        best = None
        for key, members in points.items():
            acc_m, acc_s = mean_std([100.0 * frac(m.summary["test_acc"]) for m in members])  # type: ignore[index,operator]
            t_m, t_s = mean_std([float(m.summary["train_time"]) for m in members])  # type: ignore[index]
            cand = (acc_m, -t_m, key, members, acc_s, t_s)
            if best is None or cand[:2] > best[:2]:
                best = cand
        assert best is not None
        acc_m, neg_t, key, members, acc_s, t_s = best
        cfg = dict(key)
        entry: dict[str, Any] = {
            "method": opt, "model": model, "dataset": dataset,
            "point": {k: cfg.get(k) for k in ("lr", "weight_decay", "damping") if k in cfg},
            "seeds": sorted(m.get("seed") for m in members), "n": len(members), "n_points": len(points),
            "acc_mean": acc_m, "acc_std": acc_s, "time_mean": -neg_t, "time_std": t_s,
        }
        if opt not in DAMPED:
            entry["point"]["damping"] = None
        if target_acc is not None:
            tt = [t for t in (time_to_target(m, target_acc) for m in members) if t is not None]
            entry["ttt_mean"], entry["ttt_std"] = mean_std(tt)
            entry["ttt_reached"] = len(tt)
        out.append(entry)
    out.sort(key=lambda e: (str(e["model"]), str(e["dataset"]), -e["acc_mean"]))
    return out


def _g(v: Any) -> str:
    return "-" if v is None else f"{v:g}"


def format_table(entries: Sequence[dict[str, Any]], target_acc: Optional[float] = None) -> str:
    """The summary in the paper's Table 2 format, one block per (model, dataset)."""
    lines: list[str] = []
    tgt = None if target_acc is None else 100.0 * frac(target_acc)  # type: ignore[operator]
    for (model, dataset), group in itertools.groupby(entries, key=lambda e: (e["model"], e["dataset"])):
        lines.append(f"{model} / {dataset}" + (f"   (target test accuracy {tgt:g}%)" if tgt is not None else ""))
        head = f"  {'method':<9} {'lr':>7} {'wd':>7} {'damping':>8} {'seeds':>5}  {'time (s) [test acc %]':<34}"
        if tgt is not None:
            head += f" time to {tgt:g}% (s)"
        lines.append(head)
        for e in group:
            p = e["point"]
            cell = f"{e['time_mean']:.1f} ± {e['time_std']:.1f} [{e['acc_mean']:.2f} ± {e['acc_std']:.2f}]"
            line = (f"  {e['method']:<9} {_g(p.get('lr')):>7} {_g(p.get('weight_decay')):>7} "
                    f"{_g(p.get('damping')):>8} {e['n']:>5}  {cell:<34}")
            if tgt is not None:
                if e["ttt_reached"]:
                    line += f" {e['ttt_mean']:.1f} ± {e['ttt_std']:.1f} ({e['ttt_reached']}/{e['n']})"
                else:
                    line += f" not reached (0/{e['n']})"
            lines.append(line)
        lines.append("")
    lines.append("best grid point per method by mean test accuracy; mean ± sample std over seeds")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _sweep_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tools.sweep", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--optimizer", required=True, choices=("sgd", "tengrad", "kfac", "ekfac", "kbfgs"))
    ap.add_argument("--model", default="3c1f")
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--lr", default=None, help="comma-separated grid (default: the paper's)")
    ap.add_argument("--weight-decay", default=None, help="comma-separated grid (default: the paper's)")
    ap.add_argument("--damping", default=None, help="comma-separated grid (default: the paper's; ignored for sgd)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--subset", type=int, default=None)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--jobs", type=int, default=1, help="training processes at a time (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="threads per run (default: cpu count / jobs)")
    ap.add_argument("--target-acc", type=float, default=None, help="for the time_to_target column")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--out", required=True, help="sweep directory")
    return ap


def parse_sweep_args(argv: Sequence[str]) -> argparse.Namespace:
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    a = _sweep_parser().parse_args(argv)
    a.lr = _floats(a.lr, PAPER_GRID["lr"])
    a.weight_decay = _floats(a.weight_decay, PAPER_GRID["weight_decay"])
    a.damping = _floats(a.damping, PAPER_GRID["damping"])
    a.seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    a.extra = extra
    return a


def main(argv: Optional[Sequence[str]] = None) -> Any:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "summarize":
        ap = argparse.ArgumentParser(prog="python -m tools.sweep summarize",
                                     description="Table 2: best grid point per method, mean ± std over seeds.")
        ap.add_argument("dirs", nargs="+", metavar="DIR")
        ap.add_argument("--target-acc", type=float, default=None,
                        help="also the training time to reach this test accuracy (fraction or %%)")
        ap.add_argument("--json", action="store_true", help="print the entries as JSON instead")
        a = ap.parse_args(argv[1:])
        entries = summarize(a.dirs, a.target_acc)
        if not entries:
            print(f"no finished runs in {', '.join(a.dirs)}", file=sys.stderr)
            raise SystemExit(1)
        print(json.dumps(entries, indent=2) if a.json else format_table(entries, a.target_acc))
        return entries
    res = run_sweep(parse_sweep_args(argv))
    if res["failed"]:
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()
