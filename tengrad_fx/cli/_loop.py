"""The training loop of ``tengrad_fx.cli.train``: data order, steps, evaluation, logs, atomic
checkpoints and bit-identical resume. ``tengrad_fx.cli.train`` parses and resolves the arguments
and builds the model and optimizer; :func:`train` runs them.

Files written to ``--out`` (default ``runs/<model>-<dataset>-<optimizer>-s<seed>``)
------------------------------------------------------------------------------------
``config.json``
    every resolved argument (defaults filled in) plus ``n_params``, ``steps_per_epoch``,
    ``n_train``, ``n_test``, ``optimizer_kwargs`` (what the optimizer was built with,
    e.g. K-FAC's ``curvature_every``/``inverse_every``); nothing that differs between repeats of one experiment.
``steps.jsonl`` -- one JSON object per training step, written at log points (every
``--log-every`` steps, before an evaluation, at the end of an epoch or run; see below):
    ``step`` (1-based, global), ``epoch`` (1-based epoch the step belongs to),
    ``loss`` (training loss of the batch, before the update), ``acc`` (training accuracy
    of the batch, before the update), ``lr`` (learning rate used), ``train_time``
    (cumulative training wall-clock seconds, evaluation and checkpointing excluded;
    with ``--compile`` the compilation is done before the first step and not counted;
    between log points the host's clock when the step was queued, exact at log points),
    ``skipped`` (true if the update was skipped: non-finite loss, or the optimizer
    skipped it).
``epochs.jsonl`` -- one JSON object per evaluation at the end of an epoch:
    ``epoch`` (epochs completed; fractional ``e + k/steps_per_epoch`` for a run stopped
    by ``--max-steps`` inside an epoch), ``step``, ``train_loss``, ``train_acc`` (means
    over the epoch's training batches, weighted by batch size, before each update;
    batches with a non-finite loss are left out of ``train_loss``, which is ``null`` if
    all were),
    ``test_loss``, ``test_acc`` (full test set, batches of 1000, ``torch.no_grad``),
    ``lr``, ``train_time`` (cumulative, as in steps.jsonl), ``eval_time`` (cumulative
    evaluation seconds, this evaluation included).
``evals.jsonl`` (only with ``--eval-every N``) -- one object every N steps:
    ``step``, ``epoch`` (fractional), ``test_loss``, ``test_acc``, ``train_time``, ``eval_time``.
``summary.json``
    ``test_acc``, ``test_loss``, ``train_loss``, ``train_acc`` (last epoch),
    ``train_time``, ``eval_time``, ``epochs`` (completed, fractional if stopped inside an
    epoch), ``steps``, ``samples_per_s``, ``optimizer``, ``model``, ``dataset``,
    ``skipped_steps`` (= ``skipped_nonfinite_loss`` + ``skipped_by_optimizer``),
    ``kl_clipped_steps`` (steps whose update the KL clip scaled down, ``opt.kl_clipped_steps``),
    ``compile_time`` (seconds ``--compile`` spent compiling before the first step, null
    without it), ``stopped_by_max_steps``, ``resumed_at_steps`` (steps at which ``--resume`` picked the
    run up), ``out``, ``torch`` (version), ``device_name``, ``threads``. Written last: a
    directory without it holds an unfinished run.
``checkpoint.pt``, ``checkpoint.prev.pt``
    after every epoch (and when ``--max-steps`` stops a run), written atomically (a
    temporary file in ``--out``, then ``os.replace``; the former one is kept as
    ``checkpoint.prev.pt``, see ``tengrad_fx.cli._checkpoint``): model and optimizer state dicts,
    ``epoch``/``step``/``batch_in_epoch``, the torch RNG states, the data generator's
    state at the start of the current epoch, running epoch sums, timings, skip counts,
    the config (TENGraD's state dict carries which layers its backward materializes).
    ``--resume`` restores all of it and continues with the identical trajectory: on CPU
    the parameters are bit-identical to an uninterrupted run, for any
    ``--curvature-every`` (TENGraD's state dict carries the curvature records the next
    reuse steps need, ``tengrad_fx.optim.tengrad.resume``). The jsonl logs are cut back to the checkpoint's
    step and appended to, so a run killed at any moment (``kill -9``) and resumed has
    the logs and parameters of an uninterrupted one. A truncated or corrupt
    ``checkpoint.pt`` is reported on stderr, moved to ``checkpoint.pt.corrupt``, and the
    run resumes from ``checkpoint.prev.pt``; if no checkpoint loads, ``--resume`` stops
    with an error naming the files.
``coverage.txt`` (prepared models) -- :func:`tengrad_fx.report` of the model.
``curves.png`` / ``curves.svg`` -- ``tengrad_fx.cli.plot.plot_runs`` of this run (unless ``--no-plot``).

Host syncs: a step reads nothing from the device. Its loss, correct-prediction count and
skip flag stay on the device (``_logs.StepBuffer``) and are read with one sync per log
point, which writes the interval's per-step lines and updates the epoch sums.

Non-finite losses: the step's update is skipped (parameters unchanged) and counted. With
an optimizer that skips on the device (``SYNC_FREE``: TENGraD) the step runs with the
loss multiplied by ``1`` (finite) or ``nan`` (every gradient non-finite: the optimizer's
masked update skips it, ``opt.step_applied`` is False); other optimizers (SGD, the
K-FAC family, ``--distributed``) read the loss on the host before the backward (one sync
per step) and skip the backward. TENGraD also skips non-finite gradients and failed
factorizations; ``summary.json`` counts those (``skipped_by_optimizer``) apart from the
non-finite losses.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import zoo
from ..utils.optional import require
from ._checkpoint import (CHECKPOINT, CheckpointError, load_for_resume, remove_stale, save_checkpoint,
                          save_rotating)
from ._compile_warmup import warm_up
from ._logs import JsonlLog, StepBuffer, skipped_by_optimizer, truncate_jsonl

__all__ = ["CHECKPOINT", "EVAL_BATCH", "TRAJECTORY_KEYS", "evaluate", "save_checkpoint", "train"]

# Arguments that determine the trajectory: --resume refuses a checkpoint whose config differs.
TRAJECTORY_KEYS = ("model", "dataset", "optimizer", "batch_size", "lr", "momentum", "weight_decay", "damping",
                   "curvature_every", "fisher", "kl_clip", "lr_schedule", "seed", "subset")

EVAL_BATCH = 1000

# train_ds -> (model, optimizer, coverage report or None, extra config.json entries)
Setup = Callable[[Any], "tuple[nn.Module, torch.optim.Optimizer, Optional[str], dict[str, Any]]"]


def evaluate(model: nn.Module, dataset: Any, batch_size: int = EVAL_BATCH,
             progress: bool = False) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over ``dataset`` under ``torch.no_grad`` in eval mode."""
    was_training = model.training
    model.eval()
    loss_sum, correct, n = 0.0, 0, 0
    bar = _progress(zoo.num_batches(dataset, batch_size), "eval", not progress, leave=False)
    try:
        with torch.no_grad():
            for xb, yb in zoo.batches(dataset, batch_size):
                out = model(xb)
                loss_sum += float(F.cross_entropy(out.float(), yb, reduction="sum"))
                correct += int((out.argmax(-1) == yb).sum())
                n += int(yb.shape[0])
                bar.update(1)
    finally:
        bar.close()
        model.train(was_training)
    return loss_sum / max(n, 1), correct / max(n, 1)


def _progress(total: int, desc: str, disable: bool, leave: bool = True) -> Any:
    tqdm = require("tqdm.auto", "cli", "the training CLI (progress bars)").tqdm
    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, leave=leave, file=sys.stderr)


def _skip_batches(it: Iterator[Any], k: int) -> None:
    for _ in range(k):
        next(it)


def train(cfg: dict[str, Any], *, setup: Setup, lr_factor: Callable[[str, int], float],
          error: Callable[[str], NoReturn], dist: Any = None) -> dict[str, Any]:
    """Train as configured by ``cfg`` (``tengrad_fx.cli.train.resolve_config``), write the logs and
    checkpoints described in the module docstring; returns the summary dict.

    ``setup(train_ds)`` builds ``(model, optimizer, coverage report or None, extra
    config.json entries)`` for the training set (already on ``cfg["device"]``);
    ``lr_factor(schedule, epoch)`` is the lr multiplier of a 0-based epoch; ``error(msg)``
    reports a usage error and does not return (argparse's ``parser.error``).
    ``dist``: a :class:`tengrad_fx.cli._dist.DistRun` for ``--distributed`` (see there: this rank's
    block of each global batch, DDP, rank-0-only writes), else None.
    """
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    device = torch.device(dist.device if dist is not None else cfg["device"])
    main = dist is None or dist.main  # the process that writes files and prints
    out = Path(cfg["out"])
    ckpt_path = out / CHECKPOINT

    # ---- resume: load the checkpoint first, so a config mismatch fails before any work
    ckpt: Optional[dict[str, Any]] = None
    if cfg["resume"]:
        try:
            ckpt, name = load_for_resume(out, lambda msg: print(msg, file=sys.stderr)) if out.is_dir() else (None, "")
        except CheckpointError as exc:
            error(f"--resume: {exc}")
        if ckpt is not None:
            old = ckpt["config"]
            diff = [f"{k}: checkpoint {old.get(k)!r} vs now {cfg[k]!r}" for k in TRAJECTORY_KEYS
                    if old.get(k) != cfg[k]]
            if diff:
                error(f"--resume: {out / name} was written with a different configuration: " + "; ".join(diff))
        else:
            print(f"--resume: no {ckpt_path}, starting from scratch", file=sys.stderr)

    # ---- data and model
    try:
        train_ds = zoo.get_dataset(cfg["dataset"], "train", cfg["data_dir"], download=cfg["download"])
        test_ds = zoo.get_dataset(cfg["dataset"], "test", cfg["data_dir"], download=cfg["download"])
    except (FileNotFoundError, ValueError) as exc:
        error(str(exc))
    if cfg["subset"] is not None:
        train_ds = zoo.subset(train_ds, cfg["subset"])
    n_test = cfg["subset"] if cfg.get("test_subset") is None else cfg["test_subset"]
    if n_test:
        test_ds = zoo.subset(test_ds, n_test)
    train_ds, test_ds = train_ds.to(device), test_ds.to(device)

    torch.manual_seed(cfg["seed"])
    model, opt, coverage, extra_meta = setup(train_ds)
    forward: Callable[[torch.Tensor], torch.Tensor] = torch.compile(model) if cfg["compile"] else model
    if dist is not None:
        forward = dist.wrap(model)
    out.mkdir(parents=True, exist_ok=True)  # only now: a bad --model/--dataset leaves no directory behind
    gen = torch.Generator().manual_seed(cfg["seed"])  # data order (+ augmentation), always on the CPU
    steps_per_epoch = zoo.num_batches(train_ds, cfg["batch_size"]) if dist is None else \
        len(train_ds) // cfg["batch_size"]  # distributed: the last incomplete global batch is dropped
    base_lr = cfg["lr"]

    # ---- state (fresh or from the checkpoint)
    epoch, step, batch_in_epoch = 0, 0, 0
    train_time = eval_time = 0.0
    skipped_loss = 0
    ep_loss_sum = ep_loss_n = ep_correct = ep_count = 0.0  # running sums of the current epoch
    samples = 0
    epoch_gen_state = gen.get_state()
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        epoch, step, batch_in_epoch = ckpt["epoch"], ckpt["step"], ckpt["batch_in_epoch"]
        train_time, eval_time = ckpt["train_time"], ckpt["eval_time"]
        skipped_loss = ckpt["skipped_nonfinite_loss"]
        ep_loss_sum, ep_loss_n, ep_correct, ep_count = ckpt["epoch_sums"]
        samples = ckpt["samples"]
        epoch_gen_state = ckpt["rng"]["data_epoch_start"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        if device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], device)
        last_step = step
        for name in ("steps.jsonl", "evals.jsonl", "epochs.jsonl") if main else ():
            truncate_jsonl(out / name, lambda r: r.get("step", 0) <= last_step)
        with contextlib.suppress(FileNotFoundError):
            if main:
                (out / "summary.json").unlink()  # the run is unfinished again until the new summary
    elif main:
        for name in ("steps.jsonl", "evals.jsonl", "epochs.jsonl", "summary.json"):
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()
    if main:
        remove_stale(out, fresh=ckpt is None)

    resolved = {k: v for k, v in cfg.items() if k != "resume"}
    meta = dict(resolved, resume=cfg["resume"], steps_per_epoch=steps_per_epoch,
                n_train=len(train_ds), n_test=len(test_ds), **extra_meta)
    if dist is not None:
        meta["world_size"] = dist.world
    if main:
        (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    resumed_at = list(ckpt.get("resumed_at", [])) + [step] if ckpt is not None else []
    if coverage is not None and main:
        (out / "coverage.txt").write_text(coverage + "\n")

    steps_log, epochs_log = JsonlLog(out / "steps.jsonl", main), JsonlLog(out / "epochs.jsonl", main)
    evals_log = JsonlLog(out / "evals.jsonl", main) if cfg["eval_every"] else None
    show = not cfg["no_progress"] and sys.stderr.isatty() and main
    last_eval: Optional[dict[str, Any]] = None
    max_steps = cfg["max_steps"]
    stopped = False

    def snapshot() -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "epoch": epoch,
            "step": step,
            "batch_in_epoch": batch_in_epoch,
            "train_time": train_time,
            "eval_time": eval_time,
            "skipped_nonfinite_loss": skipped_loss,
            "epoch_sums": (ep_loss_sum, ep_loss_n, ep_correct, ep_count),
            "samples": samples,
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                    "data_epoch_start": epoch_gen_state},
            "config": resolved,
            "resumed_at": resumed_at,
        }

    def do_eval() -> tuple[float, float]:
        nonlocal eval_time
        t0 = time.perf_counter()
        loss, acc = evaluate(forward_eval, test_ds, progress=show)  # type: ignore[arg-type]
        eval_time += time.perf_counter() - t0
        return loss, acc

    forward_eval = forward
    compile_time = None
    if cfg["compile"] and dist is None:  # compile every step kind now, off the training clock
        xb, yb = next(zoo.batches(train_ds, cfg["batch_size"], shuffle=False))
        last = len(train_ds) % cfg["batch_size"]
        compile_time = warm_up(forward, model, xb, yb, [len(yb)] + ([last] if last else []))
        if main:
            print(f"--compile: compiled in {compile_time:.1f}s (not counted in train_time)", flush=True)
    session_samples, session_t0 = 0, train_time
    buffer = StepBuffer()
    device_skips = dist is None and bool(getattr(opt, "SYNC_FREE", False))  # the optimizer skips on the device
    bar: Any = None

    def flush() -> None:
        """Read the buffered steps (one host sync), update the epoch sums, write steps.jsonl."""
        nonlocal train_time, skipped_loss, ep_loss_sum, ep_loss_n, ep_correct, ep_count, samples, session_samples
        t0 = time.perf_counter()
        recs = buffer.flush()
        train_time += time.perf_counter() - t0  # the device finishing the interval's steps
        for rec in recs:
            bs, correct = rec.pop("bs"), rec.pop("correct")
            if math.isfinite(rec["loss"]):
                ep_loss_sum += rec["loss"] * bs
                ep_loss_n += bs
            else:
                skipped_loss += 1
            ep_correct += correct
            ep_count += bs
            samples += bs
            session_samples += bs
        if recs:
            recs[-1]["train_time"] = train_time
        for rec in recs:
            steps_log.write(rec)
        if recs and bar is not None:
            bar.set_postfix(loss=f"{ep_loss_sum / max(ep_loss_n, 1):.4f}", acc=f"{ep_correct / max(ep_count, 1):.3f}",
                            samples_s=f"{session_samples / max(train_time - session_t0, 1e-9):.0f}", refresh=False)
    model.train()
    try:
        while epoch < cfg["epochs"] and not (max_steps is not None and step >= max_steps):
            lr = base_lr * lr_factor(cfg["lr_schedule"], epoch)
            for group in opt.param_groups:
                group["lr"] = lr
            gen.set_state(epoch_gen_state)
            it = zoo.batches(train_ds, cfg["batch_size"], shuffle=True, generator=gen, drop_last=dist is not None)
            _skip_batches(it, batch_in_epoch)
            bar = _progress(steps_per_epoch, f"epoch {epoch + 1}/{cfg['epochs']}", not show)
            bar.update(batch_in_epoch)
            while True:
                if max_steps is not None and step >= max_steps:
                    stopped = True
                    break
                t0 = time.perf_counter()
                try:
                    xb, yb = next(it)
                except StopIteration:
                    break
                if dist is not None:
                    xb, yb = dist.local(xb, yb)
                out_logits = forward(xb)
                loss = F.cross_entropy(out_logits, yb)
                correct: Any = (out_logits.detach().argmax(-1) == yb).sum()
                loss_v: Any = loss.detach()
                if dist is not None:  # the global batch's (every rank takes the same decision)
                    loss_v, correct = dist.global_stats(loss, correct)
                run_step = device_skips or math.isfinite(loss_v if dist is not None else float(loss_v))
                before = 0 if device_skips else skipped_by_optimizer(opt)
                opt.zero_grad(set_to_none=True)
                skipped: Any = True
                if run_step:
                    if hasattr(opt, "mc_capture"):
                        opt.mc_capture(out_logits)
                    if device_skips:  # a non-finite loss makes every gradient NaN: the step skips on the device
                        loss = loss * torch.where(loss_v.isfinite(), 1.0, math.nan)
                    loss.backward()
                    opt.step()
                    applied = getattr(opt, "step_applied", None)
                    skipped = (~applied if applied is not None else False) if device_skips else \
                        skipped_by_optimizer(opt) > before
                train_time += time.perf_counter() - t0
                del out_logits, loss
                bs = int(yb.shape[0]) * (1 if dist is None else dist.world)
                step += 1
                batch_in_epoch += 1
                buffer.add({"step": step, "epoch": epoch + 1, "lr": lr, "train_time": train_time, "bs": bs},
                           loss_v, correct, skipped)
                bar.update(1)
                if len(buffer) >= cfg["log_every"]:
                    flush()
                if evals_log is not None and step % cfg["eval_every"] == 0:
                    flush()
                    test_loss, test_acc = do_eval()
                    last_eval = {"step": step, "epoch": epoch + batch_in_epoch / steps_per_epoch,
                                 "test_loss": test_loss, "test_acc": test_acc, "train_time": train_time,
                                 "eval_time": eval_time}
                    evals_log.write(last_eval)
            flush()
            bar.close()
            complete = batch_in_epoch >= steps_per_epoch
            if not complete and batch_in_epoch == 0:
                break  # stopped by --max-steps exactly at an epoch boundary: nothing new to log
            test_loss, test_acc = do_eval()
            frac_epoch: float = epoch + 1 if complete else epoch + batch_in_epoch / steps_per_epoch
            train_loss = ep_loss_sum / ep_loss_n if ep_loss_n else None  # None: every loss was non-finite
            rec = {"epoch": frac_epoch, "step": step, "train_loss": train_loss,
                   "train_acc": ep_correct / max(ep_count, 1), "test_loss": test_loss, "test_acc": test_acc,
                   "lr": lr, "train_time": train_time, "eval_time": eval_time}
            epochs_log.write(rec)
            last_eval = dict(rec)
            if main:
                print(f"epoch {frac_epoch:g}: train loss {train_loss if train_loss is not None else float('nan'):.4f} "
                      f"acc {rec['train_acc']:.4f} | "
                      f"test loss {test_loss:.4f} acc {test_acc:.4f} | train {train_time:.1f}s eval {eval_time:.1f}s",
                      flush=True)
            if complete:
                epoch += 1
                batch_in_epoch = 0
                ep_loss_sum = ep_loss_n = ep_correct = ep_count = 0.0
                epoch_gen_state = gen.get_state()
            if main:
                save_rotating(ckpt_path, snapshot())
            if stopped:
                break
    finally:
        steps_log.close()
        epochs_log.close()
        if evals_log is not None:
            evals_log.close()

    if last_eval is None or last_eval["step"] != step:  # nothing trained now, or stopped at a boundary
        test_loss, test_acc = do_eval()
        last_eval = {"test_loss": test_loss, "test_acc": test_acc, "step": step}
        prev = [json.loads(x) for x in (out / "epochs.jsonl").read_text().splitlines() if x.strip()] if main else []
        if prev:
            last_eval.setdefault("train_loss", prev[-1]["train_loss"])
            last_eval.setdefault("train_acc", prev[-1]["train_acc"])
    skipped_opt = skipped_by_optimizer(opt) - (skipped_loss if device_skips else 0)  # those skipped it too
    stopped = max_steps is not None and step >= max_steps and epoch < cfg["epochs"]
    summary = {
        "test_acc": last_eval["test_acc"], "test_loss": last_eval["test_loss"],
        "train_loss": last_eval.get("train_loss"), "train_acc": last_eval.get("train_acc"),
        "train_time": train_time, "eval_time": eval_time,
        "epochs": epoch + batch_in_epoch / steps_per_epoch, "steps": step,
        "samples_per_s": (samples / train_time) if train_time > 0 else None,
        "optimizer": cfg["optimizer"], "model": cfg["model"], "dataset": cfg["dataset"],
        "skipped_steps": skipped_loss + skipped_opt, "skipped_nonfinite_loss": skipped_loss,
        "compile_time": compile_time, "skipped_by_optimizer": skipped_opt,
        "kl_clipped_steps": int(getattr(opt, "kl_clipped_steps", 0)),
        "stopped_by_max_steps": stopped, "resumed_at_steps": resumed_at,
        "out": str(out), "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
    }
    if not main:
        return summary
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    plot_msg = ""
    if not cfg["no_plot"]:
        try:
            from .plot import plot_runs

            plot_runs([str(out)], str(out / "curves.png"))
            plot_msg = f", plot {out / 'curves.png'}"
        except ImportError as exc:
            if "matplotlib" in str(exc):
                print("note: no curves.png (install matplotlib, e.g. pip install -e '.[plot]')", file=sys.stderr)
        except Exception as exc:  # a plotting problem must not lose a finished run
            print(f"warning: plotting failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    skipped_txt = f", {summary['skipped_steps']} skipped steps" if summary["skipped_steps"] else ""
    print(f"{cfg['model']} / {cfg['dataset']} / {cfg['optimizer']}: test accuracy {summary['test_acc']:.4f} "
          f"(loss {summary['test_loss']:.4f}) after {step} steps ({summary['epochs']:g} epochs){skipped_txt}; "
          f"train time {train_time:.1f} s, eval time {eval_time:.1f} s")
    print(f"logs: {out}/{{config.json,steps.jsonl,epochs.jsonl,summary.json}}, checkpoint {ckpt_path}{plot_msg}")
    return summary
