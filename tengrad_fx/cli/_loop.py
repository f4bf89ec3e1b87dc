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
    ``test_loss``, ``test_acc`` (full test set, batches of 1000, ``torch.no_grad``; when an
    ``--eval-every`` evaluation falls on the epoch's last step, its values, not evaluated twice),
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

import math
import sys
import time
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import zoo
from ..utils.optional import require
from ._checkpoint import CHECKPOINT, save_checkpoint, save_rotating
from ._compile_warmup import warm_up
from ._finish import finish
from ._logs import skipped_by_optimizer
from ._state import TRAJECTORY_KEYS, RunState, Setup, open_run

__all__ = ["CHECKPOINT", "EVAL_BATCH", "TRAJECTORY_KEYS", "evaluate", "save_checkpoint", "train"]

EVAL_BATCH = 250  # test batches: the same predictions, a quarter of the activation memory per forward


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
    st = open_run(cfg, setup, error, dist)
    assert st.logs is not None
    try:
        _compile(st)
        st.session_samples, st.session_t0 = 0, st.train_time
        st.model.train()
        while st.epoch < cfg["epochs"] and not st.at_max_steps():
            if not _run_epoch(st, cfg["lr"] * lr_factor(cfg["lr_schedule"], st.epoch)):
                break
    finally:
        st.logs.close()
    return finish(st, lambda: _evaluate_timed(st))


def _compile(st: RunState) -> None:
    """``--compile``: compile every step kind now, off the training clock."""
    if not st.cfg["compile"] or st.dist is not None:
        return
    bs = st.cfg["batch_size"]
    xb, yb = next(zoo.batches(st.train_ds, bs, shuffle=False))
    last = len(st.train_ds) % bs
    st.compile_time = warm_up(st.forward, st.model, xb, yb, [len(yb)] + ([last] if last else []))
    if st.main:
        print(f"--compile: compiled in {st.compile_time:.1f}s (not counted in train_time)", flush=True)


def _evaluate_timed(st: RunState) -> tuple[float, float]:
    """(test loss, test accuracy) of the current model; the seconds go to ``eval_time``."""
    t0 = time.perf_counter()
    loss, acc = evaluate(st.forward, st.test_ds, progress=st.show)  # type: ignore[arg-type]
    st.eval_time += time.perf_counter() - t0
    return loss, acc


def _epoch_batches(st: RunState) -> Iterator[Any]:
    """The current epoch's batches from the position ``batch_in_epoch`` on (same order as an
    uninterrupted run: the generator restarts from the epoch's saved state)."""
    st.gen.set_state(st.epoch_gen_state)
    it = zoo.batches(st.train_ds, st.cfg["batch_size"], shuffle=True, generator=st.gen,
                     drop_last=st.dist is not None)
    for _ in range(st.batch_in_epoch):
        next(it)
    return it


def _run_epoch(st: RunState, lr: float) -> bool:
    """Train (the rest of) the current epoch at ``lr``, then evaluate, log and checkpoint it;
    False when the run stops here (``--max-steps``)."""
    for group in st.opt.param_groups:
        group["lr"] = lr
    it = _epoch_batches(st)
    st.bar = _progress(st.steps_per_epoch, f"epoch {st.epoch + 1}/{st.cfg['epochs']}", not st.show)
    st.bar.update(st.batch_in_epoch)
    _train_steps(st, it, lr)
    _flush(st)
    st.bar.close()
    return _end_epoch(st, lr)


def _train_steps(st: RunState, it: Iterator[Any], lr: float) -> None:
    """Steps until the epoch's batches or ``--max-steps`` run out, with the log points and
    the ``--eval-every`` evaluations between them."""
    cfg = st.cfg
    while True:
        if st.at_max_steps():
            st.stopped = True
            return
        t0 = time.perf_counter()
        try:
            xb, yb = next(it)
        except StopIteration:
            return
        _train_step(st, xb, yb, lr, t0)
        st.bar.update(1)
        if len(st.buffer) >= cfg["log_every"]:
            _flush(st)
        if cfg["eval_every"] and st.step % cfg["eval_every"] == 0:
            _flush(st)
            _eval_point(st)


def _train_step(st: RunState, xb: torch.Tensor, yb: torch.Tensor, lr: float, t0: float) -> None:
    """One optimizer step on the batch ``(xb, yb)`` (a global batch under ``--distributed``);
    its loss, correct count and skip flag go to the step buffer without a host read
    (except where the loop must read the loss, see the module docstring). ``t0``: when the
    step started (before the batch was drawn)."""
    dist = st.dist
    if dist is not None:
        xb, yb = dist.local(xb, yb)
    logits = st.forward(xb)
    loss = F.cross_entropy(logits, yb)
    correct: Any = (logits.detach().argmax(-1) == yb).sum()
    loss_v: Any = loss.detach()
    if dist is not None:  # the global batch's (every rank takes the same decision)
        loss_v, correct = dist.global_stats(loss, correct)
    skipped = _update(st, logits, loss, loss_v)
    st.train_time += time.perf_counter() - t0
    del logits, loss
    bs = int(yb.shape[0]) * (1 if dist is None else dist.world)
    st.step += 1
    st.batch_in_epoch += 1
    st.buffer.add({"step": st.step, "epoch": st.epoch + 1, "lr": lr, "train_time": st.train_time, "bs": bs},
                  loss_v, correct, skipped)


def _update(st: RunState, logits: torch.Tensor, loss: torch.Tensor, loss_v: Any) -> Any:
    """Backward and ``opt.step()`` unless the loss is non-finite; returns the skip flag (a
    device bool for an optimizer that skips on the device, else a Python bool)."""
    opt, device_skips = st.opt, st.device_skips
    run_step = device_skips or math.isfinite(loss_v if st.dist is not None else float(loss_v))
    before = 0 if device_skips else skipped_by_optimizer(opt)
    opt.zero_grad(set_to_none=True)
    if not run_step:
        return True
    if hasattr(opt, "mc_capture"):
        opt.mc_capture(logits)
    if device_skips:  # a non-finite loss makes every gradient NaN: the step skips on the device
        loss = loss * torch.where(loss_v.isfinite(), 1.0, math.nan)
    loss.backward()
    opt.step()
    if device_skips:
        applied = getattr(opt, "step_applied", None)
        return ~applied if applied is not None else False
    return skipped_by_optimizer(opt) > before


def _flush(st: RunState) -> None:
    """Read the buffered steps (one host sync), update the epoch sums, write steps.jsonl."""
    t0 = time.perf_counter()
    recs = st.buffer.flush()
    st.train_time += time.perf_counter() - t0  # the device finishing the interval's steps
    for rec in recs:
        bs, correct = rec.pop("bs"), rec.pop("correct")
        if math.isfinite(rec["loss"]):
            st.ep_loss_sum += rec["loss"] * bs
            st.ep_loss_n += bs
        else:
            st.skipped_loss += 1
        st.ep_correct += correct
        st.ep_count += bs
        st.samples += bs
        st.session_samples += bs
    if not recs:
        return
    recs[-1]["train_time"] = st.train_time
    assert st.logs is not None
    for rec in recs:
        st.logs.steps.write(rec)
    if st.bar is not None:
        st.bar.set_postfix(loss=f"{st.ep_loss_sum / max(st.ep_loss_n, 1):.4f}",
                           acc=f"{st.ep_correct / max(st.ep_count, 1):.3f}",
                           samples_s=f"{st.session_samples / max(st.train_time - st.session_t0, 1e-9):.0f}",
                           refresh=False)


def _eval_point(st: RunState) -> None:
    """An ``--eval-every`` evaluation: one line of evals.jsonl."""
    test_loss, test_acc = _evaluate_timed(st)
    st.last_eval = {"step": st.step, "epoch": st.epoch + st.batch_in_epoch / st.steps_per_epoch,
                    "test_loss": test_loss, "test_acc": test_acc, "train_time": st.train_time,
                    "eval_time": st.eval_time}
    assert st.logs is not None and st.logs.evals is not None
    st.logs.evals.write(st.last_eval)


def _end_epoch(st: RunState, lr: float) -> bool:
    """Evaluate, log (epochs.jsonl, a printed line) and checkpoint the epoch's end (or the
    ``--max-steps`` stop inside it); False when the run stops here."""
    complete = st.batch_in_epoch >= st.steps_per_epoch
    if not complete and st.batch_in_epoch == 0:
        return False  # stopped by --max-steps exactly at an epoch boundary: nothing new to log
    if st.last_eval is not None and st.last_eval["step"] == st.step:  # --eval-every has just evaluated this model
        test_loss, test_acc = st.last_eval["test_loss"], st.last_eval["test_acc"]
    else:
        test_loss, test_acc = _evaluate_timed(st)
    frac_epoch: float = st.epoch + 1 if complete else st.epoch + st.batch_in_epoch / st.steps_per_epoch
    train_loss = st.ep_loss_sum / st.ep_loss_n if st.ep_loss_n else None  # None: every loss was non-finite
    rec = {"epoch": frac_epoch, "step": st.step, "train_loss": train_loss,
           "train_acc": st.ep_correct / max(st.ep_count, 1), "test_loss": test_loss, "test_acc": test_acc,
           "lr": lr, "train_time": st.train_time, "eval_time": st.eval_time}
    assert st.logs is not None
    st.logs.epochs.write(rec)
    st.last_eval = dict(rec)
    if st.main:
        shown_loss = train_loss if train_loss is not None else float("nan")
        print(f"epoch {frac_epoch:g}: train loss {shown_loss:.4f} acc {rec['train_acc']:.4f} | "
              f"test loss {test_loss:.4f} acc {test_acc:.4f} | train {st.train_time:.1f}s eval {st.eval_time:.1f}s",
              flush=True)
    if complete:
        st.epoch += 1
        st.batch_in_epoch = 0
        st.reset_epoch_sums()
        st.epoch_gen_state = st.gen.get_state()
    if st.main:
        save_rotating(st.out / CHECKPOINT, st.snapshot())
    return not st.stopped
