"""Each distribution's ``check`` sees every option the optimizer was built with, and refuses
what it cannot run at construction (a ``ValueError`` naming the option), never at a step.

The first tests run in one process: the dict ``TENGraD`` hands to ``check`` holds every
constructor argument (each option under its one spelling), and every key a
strategy's ``check`` reads is one of them, so no guard can test an option it is never
given. The last one spawns 2 gloo ranks: under FSDP2 the refused options raise at
construction.
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch.nn as nn

import tengrad_fx
from tengrad_fx import CurvatureSchedule, TENGraD
from tengrad_fx.distributed.fsdp import FSDPShards
from tengrad_fx.distributed.global_batch import GlobalBatch
from tengrad_fx.optim.tengrad.distribution import SingleProcess
from testing.distributed import run_ranks
from testing.fsdp_workers import train_fsdp

NAMES = {n for n in inspect.signature(TENGraD.__init__).parameters if n not in ("self", "model")}


class Recording(SingleProcess):
    """One process, keeping the options ``check`` was given."""

    def check(self, options: dict[str, Any]) -> None:
        self.options = dict(options)


class ReadLog(dict):  # type: ignore[type-arg]
    """A dict that notes every key read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)


def _options(**kwargs: Any) -> dict[str, Any]:
    """The options a TENGraD built with ``kwargs`` hands to its distribution's ``check``."""
    net = tengrad_fx.prepare(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double())
    rec = Recording()
    TENGraD(net, lr=0.1, damping=0.05, distribution=rec, **kwargs)
    return rec.options


def test_check_is_given_every_constructor_argument() -> None:
    opts = _options(graft="sgd", orthogonalize="newton-schulz", metric="factored", momentum=0.5,
                    curvature_every=3, curvature_warmup=1, strategy="factor", cuda_graph=False)
    assert set(opts) == NAMES
    assert (opts["graft"], opts["orthogonalize"], opts["metric"], opts["momentum"]) == \
        ("sgd", "newton-schulz", "factored", 0.5)
    assert (opts["curvature_every"], opts["curvature_warmup"], opts["strategy"], opts["cuda_graph"]) == \
        (3, 1, "factor", False)
    # a deprecated spelling reaches check under the keywords it stands for
    with pytest.warns(DeprecationWarning, match="pass curvature_every=5"):
        assert _options(schedule=CurvatureSchedule(every=5))["curvature_every"] == 5


def _unbuilt(cls: type, mode: str = "gather") -> Any:
    """A strategy of ``cls`` with no state but its ``mode`` (what ``check`` may read of it)."""
    obj = object.__new__(cls)
    obj.mode = mode
    return obj


@pytest.mark.parametrize("cls", [SingleProcess, GlobalBatch, FSDPShards])
def test_check_reads_only_the_options_it_is_given(cls: type) -> None:
    given = ReadLog(_options())
    cls.check(_unbuilt(cls), given)  # the defaults: accepted everywhere
    assert given.read <= NAMES, f"{cls.__name__}.check reads {sorted(given.read - NAMES)}, not options"
    assert cls is SingleProcess or given.read


REFUSED = [
    (FSDPShards, "cuda_graph", True),
]


@pytest.mark.parametrize("cls, name, value", REFUSED)
def test_refused_option_is_named(cls: type, name: str, value: Any) -> None:
    given = {**_options(), name: value}
    with pytest.raises(ValueError, match=name):
        cls.check(_unbuilt(cls), given)


@pytest.mark.parametrize("name, value", [("curvature_samples", 4), ("position_rows", 8)])
def test_global_batch_runs_the_rows_of_the_global_fisher(name: str, value: Any) -> None:
    """DDP's strategy accepts them with ``mode="gather"``, ``"gram-blocks"`` or ``"auto"``
    (``tests/distributed/test_rows.py`` checks their updates) and refuses them with ``"local"``,
    naming both."""
    for mode in ("gather", "gram-blocks", "auto"):
        GlobalBatch.check(_unbuilt(GlobalBatch, mode), {**_options(), name: value})
    with pytest.raises(ValueError, match=f"{name}.*'local'"):
        GlobalBatch.check(_unbuilt(GlobalBatch, "local"), {**_options(), name: value})


@pytest.mark.parametrize("name, value", [("curvature_samples", 4), ("position_rows", 8)])
def test_fsdp2_takes_the_rows_of_the_global_fisher(name: str, value: Any) -> None:
    """FSDP2 accepts them with ``mode="gather"``, ``"gram-blocks"`` or ``"auto"``
    (``tests/distributed/test_fsdp2_options.py`` and ``test_fsdp2_gram_rows.py`` check their updates)."""
    for mode in ("gather", "gram-blocks", "auto"):
        FSDPShards.check(_unbuilt(FSDPShards, mode), {**_options(), name: value})


@pytest.mark.parametrize("name, value", [("metric", "factored"), ("metric", "kronecker"),
                                         ("relative_damping", True), ("fisher", "gauss-newton"),
                                         ("compile", True)])
def test_global_batch_runs_the_metric_and_relative_damping(name: str, value: Any) -> None:
    """DDP's strategy accepts them, and Gauss-Newton and compile (``tests/distributed/test_options.py``
    checks their updates)."""
    GlobalBatch.check(_unbuilt(GlobalBatch), {**_options(), name: value})


@pytest.mark.parametrize("cls", [GlobalBatch, FSDPShards])
@pytest.mark.parametrize("shaping", [dict(graft="sgd"), dict(graft="rmsprop", orthogonalize=True),
                                     dict(orthogonalize="newton-schulz", orthogonalize_momentum=True)])
def test_shaping_is_accepted(cls: type, shaping: dict[str, Any]) -> None:
    """``graft``, ``orthogonalize`` and ``orthogonalize_momentum`` pass every distributed
    check (FSDP2: on the row shards, ``tests/distributed/test_fsdp2_polar.py``)."""
    cls.check(_unbuilt(cls), {**_options(), **shaping})


FSDP_REFUSED = {"cuda_graph": dict(opts=dict(cuda_graph=True))}


def test_fsdp2_refuses_at_construction(tmp_path: Path) -> None:
    """2 gloo ranks, a model ``fully_shard`` then ``prepare``: ``DistributedTENGraD`` raises
    the ``ValueError`` naming the option when it is built (before any step)."""
    cfgs = [dict(model="block", m=2, steps=1, expect_error=True, **cfg) for cfg in FSDP_REFUSED.values()]
    res = run_ranks(train_fsdp, 2, tmp_path, cfgs, timeout=300)
    for r in res:
        for name, got in zip(FSDP_REFUSED, r):
            assert "error" in got, f"{name} was accepted"
            assert f"DistributedTENGraD (FSDP2): {name}=" in got["error"], got["error"]

