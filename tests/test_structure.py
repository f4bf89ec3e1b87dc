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
    assert set(local.lacks()) == {"global_rows", "kept_rows"} and SingleProcess().lacks() == {}
