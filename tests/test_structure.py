"""The contract between the step and its distribution strategies, read from the source.

* No optimizer overrides the step skeleton's hooks: a strategy changes the step only
  through its primitives (:mod:`tengrad_fx.optim.step.sharding`).
* One ``def precondition`` in the package (the Woodbury apply, its dampings and KL dots).
* No strategy's ``check`` lists options: strategies say which capability they lack and
  why, options which capability they need (:mod:`tengrad_fx.optim.tengrad.capabilities`),
  and one shared check derives the refusals.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.distributed.fsdp import FSDPShards
from tengrad_fx.distributed.global_batch import GlobalBatch
from tengrad_fx.optim.tengrad.capabilities import CAPABILITIES, NEEDS
from tengrad_fx.optim.tengrad.distribution import SingleProcess

PACKAGE = Path(tengrad_fx.__file__).parent
STEP_HOOKS = {"step", "_device_step", "_masked_step", "_checked_step", "_apply"}


def _classes() -> dict[str, tuple[list[str], set[str], Path]]:
    """Every class of the package: ``name: (base names, method and attribute names, file)``."""
    out: dict[str, tuple[list[str], set[str], Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                methods = {f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
                attrs = {t.id for a in node.body if isinstance(a, ast.Assign) for t in a.targets
                         if isinstance(t, ast.Name)}
                if node.name in out:  # two classes of one name: read as one (the check stays as strict)
                    old = out[node.name]
                    bases, methods = old[0] + bases, old[1] | methods
                out[node.name] = (bases, methods | attrs, path)
    return out


def _derived(classes: dict[str, tuple[list[str], set[str], Path]], root: str) -> set[str]:
    """The classes deriving from ``root`` (by name, transitively), ``root`` not included."""
    found: set[str] = set()
    grew = True
    while grew:
        new = {name for name, (bases, _, _) in classes.items()
               if name not in found and any(b == root or b in found for b in bases)}
        found |= new
        grew = bool(new)
    return found


def test_no_optimizer_overrides_the_step_hooks() -> None:
    classes = _classes()
    subclasses = _derived(classes, "StepSkeleton")
    assert {"TENGraD", "DistributedTENGraD", "FSDPTENGraD", "KFAC", "KBFGS"} <= subclasses
    bad = {name: sorted(classes[name][1] & STEP_HOOKS) for name in subclasses if classes[name][1] & STEP_HOOKS}
    assert not bad, f"step hooks overridden (use the strategy's primitives instead): {bad}"


def test_one_precondition() -> None:
    defs = [(path.relative_to(PACKAGE), node.lineno) for path in sorted(PACKAGE.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "precondition"]
    assert len(defs) == 1, defs


def test_strategies_declare_capabilities_and_one_check_refuses() -> None:
    classes = _classes()
    strategies = _derived(classes, "SingleProcess")
    assert {"GlobalBatch", "FSDPShards"} <= strategies
    overriding = sorted(name for name in strategies if "check" in classes[name][1])
    assert not overriding, f"check() overridden in {overriding}: declare lacks() instead"
    body = inspect.getsource(SingleProcess.check)
    named = [need[0] for need in NEEDS if repr(need[0]) in body or f'"{need[0]}"' in body]
    assert not named, f"the shared check names options {named}: options declare their needs in NEEDS"
    keywords = set(inspect.signature(TENGraD.__init__).parameters)
    assert {need[0] for need in NEEDS} <= keywords and {need[1] for need in NEEDS} <= set(CAPABILITIES)
    fsdp, local = object.__new__(FSDPShards), object.__new__(GlobalBatch)
    fsdp.mode, local.mode = "auto", "local"
    for strategy in (fsdp, local):
        assert set(strategy.lacks()) <= set(CAPABILITIES), type(strategy).__name__
    # the capture of a reuse step cannot read FSDP2's reallocated DTensor gradients
    assert "DTensor" in fsdp.lacks()["static_buffers"]
    assert set(local.lacks()) == {"global_rows"} and SingleProcess().lacks() == {}


def test_capturable_is_derived_from_lacks() -> None:
    """Whether a strategy's step may run as a CUDA graph is what it lacks, nothing set apart."""
    classes = _classes()
    for name in _derived(classes, "SingleProcess") | {"SingleProcess"}:
        path = classes[name][2]
        assigned = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if (isinstance(t, ast.Attribute) and t.attr == "capturable")
                    or (isinstance(t, ast.Name) and t.id == "capturable")]
        assert not assigned, f"{path.name}:{assigned}: capturable set; declare a lacked capability instead"
    ddp, fsdp = object.__new__(GlobalBatch), object.__new__(FSDPShards)
    ddp.mode, fsdp.mode = "gather", "auto"
    assert SingleProcess().capturable and ddp.capturable and not fsdp.capturable
    ddp.nccl = False  # gloo: collectives on CUDA tensors are not captured
    assert "graph_collectives" in ddp.lacks() and not ddp.capturable


# the Woodbury apply's coefficients and combination, and the dampings' expressions: only in their one home
APPLY_ONLY = {"woodbury_combine", "woodbury_coefficients", "woodbury_solve", "woodbury_apply", "woodbury_push_through",
              "cholesky_solve", "cho_solve", "layer_dampings", "scaled_dampings", "relative_scales"}


def _calls(path: Path) -> list[tuple[str, int]]:
    """``(called name, line)`` of every call in ``path`` (a name or an attribute's last part)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            out.append((name, node.lineno))
    return out


def test_distributed_preconditions_and_damps_through_the_one_home() -> None:
    """Every distributed layer's ``u`` is :func:`~tengrad_fx.optim.tengrad.layer_groups.precondition`'s
    (gathered layers, FSDP2's rows, DDP's gram-blocks rows through ``rows=``) and every ``α`` is
    :func:`~tengrad_fx.optim.tengrad.cache.layer_alphas`' (the strategies add only the
    exchanges): no module of ``tengrad_fx/distributed`` calls the apply's parts or the
    dampings' expressions itself, and none defines a damping function of its own."""
    dist_dir = PACKAGE / "distributed"
    calls = {f"{path.name}:{line}": name for path in sorted(dist_dir.rglob("*.py"))
             for name, line in _calls(path) if name in APPLY_ONLY}
    assert not calls, f"the Woodbury apply or a damping formed outside its home: {calls}"
    defs = [f"{path.name}:{node.name}" for path in sorted(dist_dir.rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
            and "damping" in node.name]
    assert not defs, f"dampings computed in tengrad_fx/distributed: {defs} (use cache.layer_alphas)"
    users = {path.name for path in dist_dir.rglob("*.py") if any(name == "precondition" for name, _ in _calls(path))}
    assert "global_batch.py" in users  # the gather and gram-blocks layers alike
