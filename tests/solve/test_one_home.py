"""Every TENGraD path takes its damped factorization, Woodbury / push-through apply and
probe rule from :mod:`tengrad_fx.solve`: the modular groups path, the fused path
(``compile=True``, run eagerly) and distributed ``gram-blocks`` (one gloo rank, in process).

Each function is wrapped in ``tengrad_fx.solve`` by a counter that calls the original;
callers look them up there at call time, so a path that kept a private copy of the maths
would leave its counter at zero. The counted steps still equal an unwrapped run's bit
for bit (the wrappers change nothing)."""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import solve
from testing.calls import count_calls
from testing.distributed import free_port

SHARED = ("damped_cholesky_ex", "solve_cholesky", "woodbury_solve", "woodbury_coefficients", "woodbury_combine",
          "push_through_holds")


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of the calls of the :data:`SHARED` functions through ``tengrad_fx.solve``."""
    return count_calls(monkeypatch, {"": solve}, tuple(SHARED))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _train(opt_factory: Callable[[nn.Module], torch.optim.Optimizer], steps: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=g)
    pm = tengrad_fx.prepare(_mlp(), example_inputs=(x[:2],))
    opt = opt_factory(pm)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in pm.parameters()])


def _tengrad(**kw: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(pm: nn.Module) -> torch.optim.Optimizer:
        opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.05, curvature_every=1, kl_clip=None, **kw)
        if kw.get("compile"):
            opt._fused.fn = None  # the fused function, eagerly
        return opt
    return make


def test_groups_path_calls_the_shared_maths(calls: Counter) -> None:
    got = _train(_tengrad())
    assert calls["damped_cholesky_ex"] == 2 and calls["push_through_holds"] > 0
    assert calls["solve_cholesky"] == calls["woodbury_coefficients"] == 2  # one solve per curvature step
    calls.clear()
    assert torch.equal(got, _train(_tengrad()))


def test_fused_path_calls_the_shared_maths(calls: Counter) -> None:
    got = _train(_tengrad(compile=True))
    n = 3 * 2  # three layers, two curvature steps, one call per layer
    assert calls["damped_cholesky_ex"] == n and calls["woodbury_solve"] == n and calls["woodbury_combine"] == n
    assert (got - _train(_tengrad())).abs().max().item() < 1e-12  # the modular path's u


@pytest.fixture
def one_rank() -> Any:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gram_blocks_call_the_shared_maths(calls: Counter, one_rank: Any) -> None:
    from tengrad_fx.distributed import DistributedTENGraD

    got = _train(lambda pm: DistributedTENGraD(pm, lr=0.1, damping=0.05, mode="gram-blocks", curvature_every=1,
                                               kl_clip=None))
    assert calls["damped_cholesky_ex"] == 2 and calls["push_through_holds"] > 0
    assert calls["solve_cholesky"] > 0 and calls["woodbury_coefficients"] > 0 and calls["woodbury_combine"] > 0
    assert calls["woodbury_solve"] == 0  # no layer in a gather group
    assert (got - _train(_tengrad())).abs().max().item() < 1e-12
