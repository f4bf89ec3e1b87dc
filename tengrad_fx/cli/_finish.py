"""The end of a ``tengrad_fx.cli.train`` run: ``summary.json`` (written last: a directory
without it holds an unfinished run), the plot, the closing lines on stdout."""
from __future__ import annotations

import json
import sys
from typing import Any, Callable

import torch

from ._checkpoint import CHECKPOINT
from ._logs import skipped_by_optimizer
from ._state import RunState

__all__ = ["finish", "summarize"]


def finish(st: RunState, evaluate: Callable[[], tuple[float, float]]) -> dict[str, Any]:
    """Evaluate the final model unless the last evaluation was of it, then write
    ``summary.json`` and ``curves.png`` and print the result (rank 0); returns the summary.
    ``evaluate()``: (test loss, test accuracy) of the current model, timed."""
    if st.last_eval is None or st.last_eval["step"] != st.step:  # nothing trained now, or stopped at a boundary
        _final_eval(st, evaluate)
    summary = summarize(st)
    if not st.main:
        return summary
    (st.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_msg = _plot(st) if not st.cfg["no_plot"] else ""
    _report(st, summary, plot_msg)
    return summary


def _final_eval(st: RunState, evaluate: Callable[[], tuple[float, float]]) -> None:
    """The final model's test loss and accuracy; the training figures from the last line of
    epochs.jsonl (a resumed run that had nothing left to train)."""
    test_loss, test_acc = evaluate()
    st.last_eval = {"test_loss": test_loss, "test_acc": test_acc, "step": st.step}
    prev = [json.loads(x) for x in (st.out / "epochs.jsonl").read_text().splitlines() if x.strip()] \
        if st.main else []
    if prev:
        st.last_eval.setdefault("train_loss", prev[-1]["train_loss"])
        st.last_eval.setdefault("train_acc", prev[-1]["train_acc"])


def summarize(st: RunState) -> dict[str, Any]:
    """The ``summary.json`` dict (keys in tengrad_fx.cli._loop's docstring)."""
    cfg, last = st.cfg, st.last_eval
    assert last is not None
    skipped_opt = skipped_by_optimizer(st.opt) - (st.skipped_loss if st.device_skips else 0)  # those skipped it too
    stopped = st.at_max_steps() and st.epoch < cfg["epochs"]
    cuda = st.device.type == "cuda"
    return {
        "test_acc": last["test_acc"], "test_loss": last["test_loss"],
        "train_loss": last.get("train_loss"), "train_acc": last.get("train_acc"),
        "train_time": st.train_time, "eval_time": st.eval_time,
        "epochs": st.epoch + st.batch_in_epoch / st.steps_per_epoch, "steps": st.step,
        "samples_per_s": (st.samples / st.train_time) if st.train_time > 0 else None,
        "optimizer": cfg["optimizer"], "model": cfg["model"], "dataset": cfg["dataset"],
        "skipped_steps": st.skipped_loss + skipped_opt, "skipped_nonfinite_loss": st.skipped_loss,
        "compile_time": st.compile_time, "skipped_by_optimizer": skipped_opt,
        "kl_clipped_steps": int(getattr(st.opt, "kl_clipped_steps", 0)),
        "stopped_by_max_steps": stopped, "resumed_at_steps": st.resumed_at,
        "out": str(st.out), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(st.device) if cuda else "cpu",
        "threads": torch.get_num_threads(),
    }


def _plot(st: RunState) -> str:
    """``curves.png`` of the run; the note for the closing line ("" when there is no plot)."""
    try:
        from .plot import plot_runs

        plot_runs([str(st.out)], str(st.out / "curves.png"))
        return f", plot {st.out / 'curves.png'}"
    except ImportError as exc:
        if "matplotlib" in str(exc):
            print("note: no curves.png (install matplotlib, e.g. pip install -e '.[plot]')", file=sys.stderr)
    except Exception as exc:  # a plotting problem must not lose a finished run
        print(f"warning: plotting failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    return ""


def _report(st: RunState, summary: dict[str, Any], plot_msg: str) -> None:
    cfg, out = st.cfg, st.out
    skipped_txt = f", {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""
    print(f"{cfg['model']} / {cfg['dataset']} / {cfg['optimizer']}: test accuracy {summary['test_acc']:.4f} "
          f"(loss {summary['test_loss']:.4f}) after {st.step} steps ({summary['epochs']:g} epochs){skipped_txt}; "
          f"train time {st.train_time:.1f} s, eval time {st.eval_time:.1f} s")
    print(f"logs: {out}/{{config.json,steps.jsonl,epochs.jsonl,summary.json}}, checkpoint {out / CHECKPOINT}{plot_msg}")
