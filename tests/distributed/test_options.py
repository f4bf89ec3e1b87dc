"""Every public option of ``TENGraD`` through ``DistributedTENGraD`` (2 gloo ranks, spawned,
float64): each one either gives the update of single-process ``TENGraD`` on the
concatenated batch (``≤ 1e-10`` relative per step, the same curvature steps) or is refused
with a clear ``ValueError`` at construction. One spawn runs every configuration in turn.

:data:`COVERED` lists which configuration exercises each keyword of ``TENGraD``'s
signature (or the test file of this folder that runs it: ``position_rows`` needs a sequence
model, ``test_rows.py``); a keyword missing from it fails :func:`test_every_option_is_covered`,
so an option added to ``TENGraD`` cannot go untested (or silently ignored) on the distributed path.
"""
from __future__ import annotations

import inspect
import io
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

from tengrad_fx import Metric
from testing.dist_workers import flat_params, global_batch, make_model, mc_step
from testing.distributed import run_ranks

TOL = 1e-10
BASE = dict(lr=0.1, damping=0.05)

RUNS: dict[str, dict[str, Any]] = {
    "warmup": dict(steps=7, opts=dict(curvature_every=3, curvature_warmup=3, momentum=0.5, weight_decay=1e-3,
                                      kl_clip=0.01)),
    "growth": dict(steps=8, opts=dict(curvature_every=4, curvature_growth=2.0)),
    "growth-gram-blocks": dict(steps=7, mode="gram-blocks", opts=dict(curvature_every=3, curvature_growth=1.5,
                                                                      curvature_warmup=2)),
    "graft-orth-woodbury": dict(steps=4, opts=dict(curvature_every=2, graft="sgd", orthogonalize="newton-schulz",
                                                   orthogonalize_momentum=True, update_form="woodbury", kl_clip=None)),
    "mc-mse-materialize": dict(steps=4, opts=dict(curvature_every=2, fisher="mc", mc_loss="mse", kl_clip=None,
                                                  strategy="materialize", jacobian_budget_mb=1.0)),
    "tf32-no-graph-no-momentum": dict(steps=3, opts=dict(curvature_every=2, gram_tf32=True, cuda_graph=False,
                                                         compile=False, momentum=0.0, solve_dtype=torch.float64)),
    "params-groups": dict(steps=4, opts=dict(curvature_every=2, params="two-groups")),
    "grad-scaler": dict(steps=4, scaler=True, opts=dict(curvature_every=2, fisher="mc")),
    "cuda-graph-gram-blocks": dict(steps=6, mode="gram-blocks", opts=dict(curvature_every=3, cuda_graph=True)),
    "metric-factored-T1": dict(steps=3, opts=dict(curvature_every=1, metric=Metric("factored", beta2=0.9))),
    "metric-factored-gram-blocks-T2": dict(steps=4, mode="gram-blocks", opts=dict(curvature_every=2,
                                                                                  metric="factored")),
    "metric-kronecker-T2": dict(steps=4, opts=dict(curvature_every=2, metric=Metric("kronecker", beta2=0.9),
                                                   kl_clip=None)),
    "metric-kronecker-gram-blocks-T1": dict(steps=3, mode="gram-blocks", opts=dict(curvature_every=1,
                                                                                   metric="kronecker")),
    # S recomputed on reuse steps: each rank's kept rows rescaled by S_old⁻¹ S_new and moved again (every
    # step with root_every=1: the rescale's rounding grows with S's condition number, so 4 steps)
    "metric-roots-T3": dict(steps=4, opts=dict(curvature_every=3, metric=Metric("kronecker", beta2=0.9, root_every=1),
                                               kl_clip=None)),
    "metric-roots-kl-T3": dict(steps=6, opts=dict(curvature_every=3, metric=Metric("kronecker", beta2=0.9,
                                                                                  root_every=2), kl_clip=1e-3)),
    "metric-roots-gram-blocks-T3": dict(steps=6, mode="gram-blocks", opts=dict(
        curvature_every=3, metric=Metric("factored", beta2=0.9, root_every=2), relative_damping=True)),
    "metric-roots-samples-gram-blocks-T3": dict(steps=5, mode="gram-blocks", opts=dict(
        curvature_every=3, metric=Metric("kronecker", beta2=0.9, root_every=1), curvature_samples=4, fisher="mc")),
    "relative-T2": dict(steps=4, opts=dict(curvature_every=2, relative_damping=True)),
    "relative-gram-blocks-T1": dict(steps=3, mode="gram-blocks", opts=dict(curvature_every=1, update_form="woodbury",
                                                                           relative_damping=True, kl_clip=None)),
    # per-group α times the relative scale; the damping changes at a reuse step (refactorized there)
    "relative-groups-damping-gram-blocks-T2": dict(steps=4, mode="gram-blocks", damping_at={3: 0.2},
                                                   opts=dict(curvature_every=2, relative_damping=True,
                                                             params="two-groups")),
    "relative-groups-damping-gather-T2": dict(steps=4, damping_at={3: 0.2},
                                              opts=dict(curvature_every=2, relative_damping=True,
                                                        params="two-groups", metric="factored")),
    # state_dict saved after step 2, loaded into a new optimizer (and model) that takes steps 3 and 4
    "kronecker-relative-resume-gram-blocks-T1": dict(steps=4, mode="gram-blocks", resume_at=2,
                                                     opts=dict(curvature_every=1, metric=Metric("kronecker", beta2=0.5),
                                                               fisher="mc", relative_damping=True)),
    "factored-relative-resume-gather-T1": dict(steps=4, resume_at=2, opts=dict(
        curvature_every=1, metric=Metric("factored", beta2=0.5), relative_damping=True)),
    # the exact GGN of a regression (4 outputs: 4 backwards, m·4 rows per rank)
    "gauss-newton-T1": dict(steps=3, mse=True, opts=dict(curvature_every=1, fisher="gauss-newton", kl_clip=None)),
    "gauss-newton-T2": dict(steps=4, mse=True, opts=dict(curvature_every=2, fisher="gauss-newton")),
    "gauss-newton-gram-blocks-T1": dict(steps=3, mode="gram-blocks", mse=True,
                                        opts=dict(curvature_every=1, fisher="gauss-newton", kl_clip=None)),
    "gauss-newton-gram-blocks-T2": dict(steps=4, mode="gram-blocks", mse=True,
                                        opts=dict(curvature_every=2, fisher="gauss-newton")),
    # the GGN of the global batch's first k samples: rank 0's 3 and one of rank 1's; rank 0's 2 (rank 1 holds none)
    "gauss-newton-samples4-T1": dict(steps=4, mse=True, opts=dict(curvature_every=1, fisher="gauss-newton",
                                                                  curvature_samples=4, kl_clip=None)),
    "gauss-newton-samples2-T2": dict(steps=4, mse=True, opts=dict(curvature_every=2, fisher="gauss-newton",
                                                                  curvature_samples=2)),
    "gauss-newton-samples2-gram-blocks-T1": dict(steps=4, mode="gram-blocks", mse=True, opts=dict(
        curvature_every=1, fisher="gauss-newton", curvature_samples=2, kl_clip=None)),
    "gauss-newton-samples4-gram-blocks-T2": dict(steps=4, mode="gram-blocks", mse=True, opts=dict(
        curvature_every=2, fisher="gauss-newton", curvature_samples=4)),
    # compile=True runs the distributed steps unfused: compile=False's update (the reference's option)
    "compile-T2": dict(steps=4, reference=dict(compile=False), opts=dict(curvature_every=2, compile=True)),
    "compile-gram-blocks-T1": dict(steps=3, mode="gram-blocks", reference=dict(compile=False),
                                   opts=dict(curvature_every=1, compile=True, kl_clip=None)),
    # the first 4 of the 6 samples: rank 0's 3 and one of rank 1's
    "curvature-samples-T2": dict(steps=4, opts=dict(curvature_every=2, curvature_samples=4, kl_clip=None)),
}
REFUSED: dict[str, dict[str, Any]] = {
    "distribution": dict(distribution="single-process"),
}
COVERED = {
    "momentum": "warmup", "weight_decay": "warmup", "curvature_every": "warmup", "curvature_warmup": "warmup",
    "curvature_growth": "growth", "graft": "graft-orth-woodbury", "orthogonalize": "graft-orth-woodbury",
    "orthogonalize_momentum": "graft-orth-woodbury",
    "curvature_samples": "curvature-samples-T2", "position_rows": "test_rows.py",
    "fisher": "gauss-newton-gram-blocks-T2", "mc_loss": "mc-mse-materialize",
    "kl_clip": "warmup", "update_form": "graft-orth-woodbury", "solve_dtype": "tf32-no-graph-no-momentum",
    "jacobian_budget_mb": "mc-mse-materialize", "strategy": "mc-mse-materialize",
    "compile": "compile-gram-blocks-T1",
    "cuda_graph": "cuda-graph-gram-blocks", "gram_tf32": "tf32-no-graph-no-momentum",
    "grad_scaler": "grad-scaler", "params": "params-groups", "distribution": "refused",
    "metric": "metric-kronecker-gram-blocks-T1", "relative_damping": "relative-gram-blocks-T1",
}


def _options(net: torch.nn.Module, opts: dict[str, Any], scaler: Optional[Any]) -> dict[str, Any]:
    """``opts`` with the placeholders made real (param groups, the distribution, the scaler)."""
    from tengrad_fx.optim.tengrad.distribution import SingleProcess
    out = dict(opts)
    if out.get("params") == "two-groups":
        named = list(net.named_parameters())
        out["params"] = [{"params": [p for n, p in named if not n.startswith("4.")]},
                         {"params": [p for n, p in named if n.startswith("4.")], "lr": 0.05, "damping": 0.3}]
    if out.get("distribution") == "single-process":
        out["distribution"] = SingleProcess()
    if scaler is not None:
        out["grad_scaler"] = scaler
    return out


def _train(opt: Any, net: torch.nn.Module, fwd: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
           scaler: Optional[Any], damping_at: Optional[dict[int, float]] = None,
           resume: Optional[tuple[int, Any]] = None, mse: bool = False) -> dict[str, Any]:
    """Steps over ``batches``: parameters after each, curvature flags, the MC targets drawn.
    ``damping_at``: step -> the damping of every param group from that step on; ``resume``:
    ``(k, remake)``: before step ``k``, ``(opt, net, fwd) = remake(opt, net)``; ``mse``: a
    regression loss (the outputs against ``sin`` of the first inputs) in place of the classes'."""
    traj, curv, drawn = [flat_params(net)], [], []
    for k, (x, y) in enumerate(batches):
        if resume is not None and k == resume[0]:
            opt, net, fwd = resume[1](opt, net)
        for group in opt.param_groups if damping_at and k in damping_at else []:
            group["damping"] = damping_at[k]  # type: ignore[index]
        curv.append(opt._is_curvature_step())
        out = fwd(x)
        loss = F.mse_loss(out, torch.sin(x[:, :out.shape[1]])) if mse else F.cross_entropy(out, y)
        drawn.append(mc_step(opt, out, loss, scaler))
        traj.append(flat_params(net))
    return {"traj": traj, "curv": curv, "targets": drawn, "curvature_steps": opt.curvature_steps}


def option_ranks(rank: int, world: int, runs: dict[str, dict[str, Any]], refused: dict[str, dict[str, Any]],
                 m: int) -> dict[str, Any]:
    """On each rank: every run of ``runs`` (``DistributedTENGraD`` on this rank's shard),
    and the error each ``refused`` option raises at construction (None: none raised)."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    out: dict[str, Any] = {"runs": {}, "refused": {}}
    for name, opts in refused.items():
        net = tengrad_fx.prepare(make_model("mlp"))
        try:
            DistributedTENGraD(DDP(net), mode="gather", placement="owner", **BASE, **_options(net, opts, None))
            out["refused"][name] = None
        except ValueError as exc:
            out["refused"][name] = str(exc)
    for name, run in runs.items():
        net = tengrad_fx.prepare(make_model("mlp"))
        ddp = DDP(net)
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0) if run.get("scaler") else None
        opt = DistributedTENGraD(ddp, mode=run.get("mode", "gather"), placement="owner", **BASE,
                                 **_options(net, run["opts"], scaler))
        batches = [global_batch("mlp", world * m, k) for k in range(run["steps"])]
        batches = [(x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m]) for x, y in batches]
        resume = (run["resume_at"], lambda o, n, r=run: _reloaded(o, n, r)) if "resume_at" in run else None
        fused, calls = opt._fused, []  # the compiled fused update: never called on the distributed path
        opt._fused = lambda *args, f=fused, c=calls: c.append(1) or f(*args)
        out["runs"][name] = _train(opt, net, ddp, batches, scaler, damping_at=run.get("damping_at"), resume=resume,
                                   mse=run.get("mse", False))
        out["runs"][name]["fused_calls"] = len(calls)
    return out


def _reloaded(opt: Any, net: torch.nn.Module, run: dict[str, Any]) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """A new model and ``DistributedTENGraD`` loaded from ``net``'s and ``opt``'s state dicts
    (through ``torch.save``)."""
    import tengrad_fx
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tengrad_fx.distributed import DistributedTENGraD
    buf = io.BytesIO()
    torch.save({"model": net.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    new = tengrad_fx.prepare(make_model("mlp"))
    new.load_state_dict(saved["model"])
    ddp = DDP(new)
    opt = DistributedTENGraD(ddp, mode=run.get("mode", "gather"), placement="owner", **BASE,
                             **_options(new, run["opts"], None))
    opt.load_state_dict(saved["opt"])
    return opt, new, ddp


def _single(run: dict[str, Any], M: int) -> dict[str, Any]:
    """Single-process TENGraD on the concatenated batch, with the run's options updated by
    its ``reference`` ones; MC labels its own, from the generator seeded as the ranks' (0)."""
    import tengrad_fx
    net = tengrad_fx.prepare(make_model("mlp"))
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0) if run.get("scaler") else None
    opt = tengrad_fx.TENGraD(net, **BASE, **_options(net, {**run["opts"], **run.get("reference", {})}, scaler))
    opt.seed_mc(0)
    batches = [global_batch("mlp", M, k) for k in range(run["steps"])]
    return _train(opt, net, net, batches, scaler, damping_at=run.get("damping_at"), mse=run.get("mse", False))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    d: Path = tmp_path_factory.mktemp("options")
    return run_ranks(option_ranks, 2, d, RUNS, REFUSED, 3)


def test_every_option_is_covered() -> None:
    """Each keyword of ``TENGraD`` (after ``model, lr, damping``) names a run or a refusal here."""
    from tengrad_fx import TENGraD
    params = list(inspect.signature(TENGraD.__init__).parameters.values())[4:]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params)
    missing = sorted(p.name for p in params if p.name not in COVERED)
    assert not missing, f"TENGraD options without a distributed check here: {missing}"
    for name, where in COVERED.items():
        elsewhere = Path(__file__).with_name(where)
        assert where in RUNS or (where == "refused" and name in REFUSED) or (
            elsewhere.suffix == ".py" and f"{name}=" in elsewhere.read_text()), (name, where)


@pytest.mark.parametrize("name", list(RUNS))
def test_option_gives_the_global_batch_update(ranks: list[dict[str, Any]], name: str) -> None:
    run = RUNS[name]
    got = [r["runs"][name] for r in ranks]
    ref = _single(run, 2 * 3)
    assert got[0]["curv"] == got[1]["curv"] == ref["curv"], "curvature steps differ from single-process TENGraD"
    assert got[0]["curvature_steps"] == ref["curvature_steps"]
    for k in range(1, run["steps"] + 1):
        d, dr = got[0]["traj"][k] - got[0]["traj"][k - 1], ref["traj"][k] - ref["traj"][k - 1]
        err = ((d - dr).norm() / dr.norm()).item()
        assert err <= TOL, f"step {k - 1}: relative error {err:.2e} of the update vs the global-batch one"
        assert torch.equal(got[1]["traj"][k], got[0]["traj"][k]), f"the ranks differ after step {k - 1}"
    assert got[0]["fused_calls"] == got[1]["fused_calls"] == 0, "a distributed step took the fused update"


def test_schedule_options_change_the_curvature_steps(ranks: list[dict[str, Any]]) -> None:
    """The schedule runs the warm-up and growth on the distributed path (the check above
    would pass with a schedule ignored on both sides; these are the intended steps)."""
    runs = ranks[0]["runs"]
    assert runs["warmup"]["curv"] == [True, True, True, False, False, True, False]
    assert runs["growth"]["curv"] == [True, False, True, False, False, False, True, False]


@pytest.mark.parametrize("name", list(REFUSED))
def test_unsupported_option_is_a_clear_error(ranks: list[dict[str, Any]], name: str) -> None:
    for r in ranks:
        msg = r["refused"][name]
        assert msg is not None, f"{name} was accepted"
        assert name in msg and "DistributedTENGraD" in msg, msg
