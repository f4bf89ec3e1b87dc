"""Options × strategies: every keyword of ``TENGraD`` and the presets, on single-process
TENGraD (the reference, in this process, on the concatenated global batch) and under DDP
(``mode="gather"`` and ``"gram-blocks"``), FSDP2 and HSDP (2 × 2), float64, gloo ranks
spawned from here (:mod:`testing.matrix_workers`). After :data:`~testing.matrix_workers.STEPS`
steps every parameter equals the reference's to ``1e-10`` (relative to its movement),
every rank holds the same parameters. The reference draws its own MC labels and position
rows from its generator seeded as the ranks' shared one (``seed_mc(0)``): the ranks' draws
of their slices of the global batch are its draws.

A combination the strategy cannot run is a ``ValueError`` naming the option at
construction (:data:`REFUSED`, each with its reason); nothing may fail at a step. One
spawn per (strategy, world size) runs all its cases in turn.
"""
from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from tengrad_fx import Metric, TENGraD
from tengrad_fx.optim.tengrad.spellings import DEPRECATED
from testing.distributed import run_ranks
from testing.matrix_workers import CORE, matrix_ranks, train_reference

TOL = 1e-10
ALL, LM, CNN, GPT2 = ("gpt2", "llama", "cnn"), ("gpt2", "llama"), ("cnn",), ("gpt2",)

CASES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    # name -> (TENGraD keywords over CORE, models)
    "core": ({}, ALL),  # lr, damping, momentum, weight_decay, curvature_every (testing.matrix_workers.CORE)
    "plain-T1": (dict(curvature_every=1, momentum=0.0, weight_decay=0.0, lr=0.3, damping=0.2), CNN),
    "warmup": (dict(curvature_every=3, curvature_warmup=2), CNN),
    "growth": (dict(curvature_every=3, curvature_growth=2.0), GPT2),
    "graft-sgd": (dict(graft="sgd"), CNN),
    "graft-rmsprop": (dict(graft="rmsprop"), GPT2),
    "orthogonalize-eigh": (dict(orthogonalize=True), GPT2),
    "orthogonalize-ns": (dict(orthogonalize="newton-schulz"), CNN),
    "orthogonalize-momentum": (dict(orthogonalize="newton-schulz", orthogonalize_momentum=True), GPT2),
    "metric-factored": (dict(metric=Metric("factored", beta2=0.9)), GPT2),
    "metric-kronecker": (dict(metric="kronecker"), CNN),
    # S recomputed on both reuse steps (GPT-2's Kronecker roots amplify rounding past 1e-10 with or without it)
    "metric-roots": (dict(metric=Metric("factored", beta2=0.9, root_every=1), curvature_every=3), ALL),
    "metric-roots-kronecker": (dict(metric=Metric("kronecker", beta2=0.9, root_every=1), curvature_every=3), CNN),
    "relative-damping": (dict(relative_damping=True), CNN),
    "curvature-samples": (dict(curvature_samples=3), CNN),
    "position-rows": (dict(position_rows=5), LM),
    "mc": (dict(fisher="mc"), ALL),
    "gauss-newton": (dict(fisher="gauss-newton"), CNN),  # 3 outputs: 3 backwards per curvature step
    "mc-mse": (dict(fisher="mc", mc_loss="mse"), CNN),
    "kl-clip": (dict(kl_clip=1e-3), GPT2),
    "woodbury": (dict(update_form="woodbury"), CNN),
    "solve-dtype": (dict(solve_dtype=torch.float64), CNN),
    "materialize": (dict(strategy="materialize", jacobian_budget_mb=1.0), CNN),
    "factor": (dict(strategy="factor", jacobian_budget_mb=0.0), GPT2),
    "compile": (dict(compile="eager"), CNN),  # the fused update (dynamo, eager backend: no codegen)
    "cuda-graph": (dict(cuda_graph=True), CNN),  # on CPUs the same code, eagerly
    "gram-tf32": (dict(gram_tf32=True), CNN),
    "grad-scaler": (dict(grad_scaler="scaler"), CNN),
    "param-groups": (dict(params="two-groups"), GPT2),
    "distribution": (dict(distribution="single-process"), CNN),
    "preset-lm": (dict(preset="lm"), ALL),
    "preset-orthogonal": (dict(preset="orthogonal"), ALL),
    "preset-orthogonal-ns": (dict(preset="orthogonal", orthogonalize="newton-schulz"), ALL),
}
KEYWORDS: dict[str, tuple[str, ...]] = {
    # every keyword of TENGraD.__init__ -> the cases that give it a value other than its default
    "lr": ("core", "plain-T1"), "damping": ("core", "plain-T1"), "momentum": ("core", "plain-T1"),
    "weight_decay": ("core",), "curvature_every": ("core", "plain-T1"), "curvature_warmup": ("warmup",),
    "curvature_growth": ("growth",), "graft": ("graft-sgd", "graft-rmsprop", "preset-orthogonal"),
    "orthogonalize": ("orthogonalize-eigh", "orthogonalize-ns", "preset-orthogonal-ns"),
    "orthogonalize_momentum": ("orthogonalize-momentum",),
    "metric": ("metric-factored", "metric-kronecker", "metric-roots", "metric-roots-kronecker"),
    "relative_damping": ("relative-damping",), "curvature_samples": ("curvature-samples",),
    "position_rows": ("position-rows", "preset-lm"), "fisher": ("mc", "gauss-newton"), "mc_loss": ("mc-mse",),
    "kl_clip": ("kl-clip", "plain-T1"), "update_form": ("woodbury",), "solve_dtype": ("solve-dtype",),
    "jacobian_budget_mb": ("materialize", "factor"), "strategy": ("materialize", "factor"),
    "compile": ("compile",), "cuda_graph": ("cuda-graph",), "gram_tf32": ("gram-tf32",),
    "grad_scaler": ("grad-scaler",), "params": ("param-groups",), "distribution": ("distribution",),
}
NOT_KEYWORDS = set(DEPRECATED)  # deprecated spellings (a DeprecationWarning): not in the signature

REFUSED: dict[tuple[str, str], str] = {
    # (strategy family, keyword) -> why that strategy cannot run it; the ValueError at construction names it
    ("ddp", "distribution"): "DistributedTENGraD brings its own distribution (GlobalBatch)",
    ("fsdp", "distribution"): "DistributedTENGraD brings its own distribution (FSDPShards)",
    ("fsdp", "cuda_graph"): "a replay's static gradient buffers cannot hold FSDP2's DTensor gradients",
}
STRATEGIES = {("ddp-gather", 2): "ddp", ("ddp-gram-blocks", 2): "ddp", ("fsdp", 2): "fsdp",
              ("ddp-gather", 4): "ddp", ("ddp-gram-blocks", 4): "ddp", ("hsdp", 4): "fsdp"}
# the 2-rank spawns run the same code paths (HSDP's replicate dim: tests/distributed/test_fsdp2.py, by default)
SLOW = {("ddp-gather", 4), ("ddp-gram-blocks", 4), ("hsdp", 4)}


def _refused_by(family: str, case: dict[str, Any]) -> list[str]:
    """The keywords of ``case`` that :data:`REFUSED` lists for ``family`` (``fisher``: only
    ``"gauss-newton"`` under FSDP2; a preset's keywords count)."""
    from tengrad_fx.optim.registry import PRESETS
    given = {**PRESETS["tengrad"].get(case.get("preset", ""), {}), **case}
    return [k for k in given if (family, k) in REFUSED and (k != "fisher" or given[k] == "gauss-newton")]


def _jobs() -> dict[str, tuple[str, dict[str, Any]]]:
    return {f"{model}/{name}": (model, case) for name, (case, models) in CASES.items() for model in models}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``spawned(strategy, W)``: every job's per-rank results; one spawn per world size runs
    every strategy of that size."""
    cache: dict[int, list[Any]] = {}

    def get(strategy: str, world: int) -> list[Any]:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"matrix-{world}")
            strategies = [s for s, w in STRATEGIES if w == world]
            cache[world] = run_ranks(matrix_ranks, world, out, strategies, _jobs(), timeout=1200.0)
        return [r[strategy] for r in cache[world]]
    return get


@pytest.fixture(scope="module")
def references() -> Any:
    """``reference(model, case name)``: single-process TENGraD's run (computed once)."""
    cache: dict[tuple[str, str], dict[str, Any]] = {}

    def get(model: str, name: str) -> dict[str, Any]:
        if (model, name) not in cache:
            cache[model, name] = train_reference(model, CASES[name][0])
        return cache[model, name]
    return get


def test_every_keyword_has_a_case() -> None:
    """Each keyword of ``TENGraD.__init__`` has a case here that sets it (a new keyword
    without one fails), and no deprecated spelling is in the signature."""
    names = [n for n in inspect.signature(TENGraD.__init__).parameters if n not in ("self", "model")]
    missing = sorted(set(names) - set(KEYWORDS))
    assert not missing, f"TENGraD keywords without a case in test_matrix.py's CASES/KEYWORDS: {missing}"
    assert not NOT_KEYWORDS & set(names), "a deprecated spelling is in TENGraD's signature"
    assert set(KEYWORDS) <= set(names), f"KEYWORDS names what TENGraD does not take: {set(KEYWORDS) - set(names)}"
    for keyword, cases in KEYWORDS.items():
        for name in cases:
            opts = CASES[name][0]
            if "preset" in opts:
                from tengrad_fx.optim.registry import PRESETS
                opts = {**PRESETS["tengrad"][opts["preset"]], **opts}
            assert keyword in opts or keyword in CORE, f"case {name!r} does not set {keyword}"
    for family, keyword in REFUSED:
        assert keyword in KEYWORDS, (family, keyword)


def _params(strategy: str, world: int) -> list[Any]:
    marks = [pytest.mark.slow] if (strategy, world) in SLOW else []
    return [pytest.param(strategy, world, job, id=f"{strategy}-{world}-{job}", marks=marks) for job in _jobs()]


@pytest.mark.parametrize("strategy, world, job", [p for key in STRATEGIES for p in _params(*key)])
def test_case_matches_single_process(spawned: Any, references: Any, strategy: str, world: int, job: str) -> None:
    model, name = job.split("/")
    got = [r[job] for r in spawned(strategy, world)]
    refused = _refused_by(STRATEGIES[strategy, world], CASES[name][0])
    errors = {k: g[k] for g in got for k in ("construction", "step") if k in g}
    assert "step" not in errors, f"{strategy} × {name} on {model} failed at a step:\n{errors['step']}"
    if refused:
        msg = errors.get("construction")
        assert msg is not None, (f"{strategy} × {name} on {model} is now supported: remove "
                                 f"{[(STRATEGIES[strategy, world], k) for k in refused]} from REFUSED")
        assert msg.startswith("ValueError") and any(f"{k}=" in msg for k in refused), msg
        references(model, name)  # single-process TENGraD runs it
        return
    assert not errors, f"{strategy} × {name} on {model} refused at construction: {errors}"
    ref = references(model, name)
    assert got[0]["curvature_steps"] == ref["curvature_steps"]
    moved = max((ref["end"][n] - ref["start"][n]).norm().item() for n in ref["end"])
    for n, want in ref["end"].items():
        scale = max((want - ref["start"][n]).norm().item(), 1e-6 * moved)
        err = (got[0]["end"][n] - want).norm().item() / scale
        assert err <= TOL, f"{strategy} × {name} on {model}, {n}: relative error {err:.2e} vs single-process TENGraD"
        assert all(torch.equal(g["end"][n], got[0]["end"][n]) for g in got[1:]), f"{n}: the ranks differ"


def test_refusals_name_a_reason() -> None:
    """Every entry of :data:`REFUSED` says why (and names a strategy family of :data:`STRATEGIES`)."""
    for (family, keyword), why in REFUSED.items():
        assert family in set(STRATEGIES.values()) and len(why) > 20, (family, keyword)


# ------------------------------------------------------------------ checkpoints
CHECKPOINT_CASES: dict[str, dict[str, Any]] = {
    # the options that keep state between steps (on GPT-2), saved after CUT steps, then loaded
    "momentum": {}, "graft-rmsprop": dict(graft="rmsprop"),  # the graft's second moments
    "orthogonalize-momentum": dict(orthogonalize="newton-schulz", orthogonalize_momentum=True),
    "mc": dict(fisher="mc"),  # the label generator
    "metric-factored": dict(metric="factored"), "metric-kronecker": dict(metric="kronecker"),  # the moments
    "relative-damping": dict(relative_damping=True), "position-rows": dict(position_rows=5),  # the row generator
    "preset-lm": dict(preset="lm", curvature_every=2),
}
# saved on 2 ranks, loaded on 4: every case under FSDP2 (resharded); under DDP the MC ones (the
# generator every rank shares draws the global batch's labels, whatever the world size)
RESHARDED = {"fsdp": list(CHECKPOINT_CASES), "ddp-gather": ["mc", "preset-lm"]}


def _checkpoint_jobs(names: Any = None) -> dict[str, tuple[str, dict[str, Any]]]:
    return {name: ("gpt2", case) for name, case in CHECKPOINT_CASES.items() if names is None or name in names}


CHECKPOINTED = ["ddp-gather", "ddp-gram-blocks", "fsdp"]  # 2 ranks; FSDP2's saves are loaded on 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``checkpoints(strategy)``: per-rank round trips of 2 ranks (one spawn for all of
    :data:`CHECKPOINTED`); ``checkpoints(strategy, 4)``: the runs of 4 ranks loaded from
    their saves (:data:`RESHARDED`, one spawn)."""
    from testing.matrix_checkpoints import resumed_ranks, round_trip_ranks
    cache: dict[int, Any] = {}
    root = tmp_path_factory.mktemp("ckpt") / "dcp"

    def get(strategy: str, world: int = 2) -> Any:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{world}")
            if world == 2:
                cache[2] = run_ranks(round_trip_ranks, 2, out, CHECKPOINTED, _checkpoint_jobs(), str(root),
                                     timeout=1200.0)
            else:
                plan = {s: _checkpoint_jobs([n for n in names if "full" in get(s)[0][n]])
                        for s, names in RESHARDED.items()}
                cache[world] = run_ranks(resumed_ranks, world, out, plan, str(root), timeout=800.0)
        return [r[strategy] for r in cache[world]]
    return get


@pytest.mark.parametrize("strategy", CHECKPOINTED)
@pytest.mark.parametrize("name", list(CHECKPOINT_CASES))
def test_checkpoint_continues_bit_for_bit(checkpoints: Any, strategy: str, name: str) -> None:
    """Saved after CUT steps and loaded into a new model and optimizer on the same ranks:
    the last steps give the uninterrupted run's parameters bit for bit."""
    got = [r[name] for r in checkpoints(strategy)]
    refused = _refused_by(STRATEGIES[strategy, 2], CHECKPOINT_CASES[name])
    if refused:
        msg = got[0].get("construction")
        assert msg is not None, f"{strategy} × {name} is now supported: remove {refused} from REFUSED"
        return
    assert "construction" not in got[0], got[0]
    for g in got:
        for n, want in g["full"]["end"].items():
            assert torch.equal(g["resumed"]["end"][n], want), f"{strategy} × {name}, {n}: the resumed run differs"


@pytest.mark.parametrize("strategy, name", [(s, n) for s, names in RESHARDED.items() for n in names])
def test_checkpoint_reshards(checkpoints: Any, strategy: str, name: str) -> None:
    """A checkpoint of 2 ranks loaded on 4 (float64; FSDP2's resharded): the last steps give
    the uninterrupted 2-rank run's parameters to ``1e-10`` (relative to their movement), MC
    labels included."""
    saved = checkpoints(strategy)[0][name]
    if _refused_by(STRATEGIES[strategy, 2], CHECKPOINT_CASES[name]):  # nothing saved; now supported: remove it
        assert "construction" in saved, f"{name} is now supported under {strategy}: remove it from REFUSED"
        return
    full = saved["full"]
    got = [r[name]["resumed"] for r in checkpoints(strategy, 4)]
    moved = max((want - got[0]["start"][n]).norm().item() for n, want in full["end"].items())
    for n, want in full["end"].items():
        scale = max((want - got[0]["start"][n]).norm().item(), 1e-6 * moved)
        err = (got[0]["end"][n] - want).norm().item() / scale
        assert err <= TOL, f"{strategy} × {name}, {n}: relative error {err:.2e} after resuming 2 -> 4 ranks"
        assert all(torch.equal(g["end"][n], got[0]["end"][n]) for g in got[1:]), f"{n}: the ranks differ"
