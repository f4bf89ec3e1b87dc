"""The package's classes are built from parts, not stacks of mixins: no class of
``tengrad_fx`` has more than one base class from ``tengrad_fx`` (``TENGraD(StepSkeleton)``
is fine, ``TENGraD(A, B, StepSkeleton)`` is not)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import tengrad_fx


def _package_classes() -> list[type]:
    classes = []
    for info in pkgutil.walk_packages(tengrad_fx.__path__, "tengrad_fx."):
        module = importlib.import_module(info.name)
        classes += [c for _, c in inspect.getmembers(module, inspect.isclass) if c.__module__ == info.name]
    return classes


def _package_bases(cls: type) -> list[type]:
    return [b for b in cls.__bases__ if b.__module__.split(".")[0] == "tengrad_fx"]


def test_no_class_has_two_package_bases() -> None:
    classes = _package_classes()
    names = {c.__name__ for c in classes}
    assert {"TENGraD", "DistributedTENGraD", "StepSkeleton", "GlobalBatch"} <= names  # the walk found them
    assert _package_bases(next(c for c in classes if c.__name__ == "DistributedTENGraD"))  # the check sees bases
    offenders = {f"{c.__module__}.{c.__qualname__}": [b.__name__ for b in _package_bases(c)]
                 for c in classes if len(_package_bases(c)) > 1}
    assert not offenders, offenders
