"""Each stacked form's Gram, ``J g`` and ``Jᵀ c`` have one home in :mod:`tengrad_fx.curvature`
(:mod:`~tengrad_fx.curvature.materialized`, :mod:`~tengrad_fx.curvature.factored`,
:mod:`~tengrad_fx.curvature.conv_stack`), and every TENGraD path that has the form calls
it: the modular groups path, the fused path (``compile=True``, its function run eagerly;
materialized and factored Linear layers only) and distributed ``gram-blocks`` (one gloo
rank, in process).

Each kernel is wrapped in its module by a counter that calls the original; callers look
them up there at call time, so a path that kept a private copy of a form's maths would
leave the counters at zero. The counted steps still equal an unwrapped run's bit for bit.
A source scan checks that the factor Gram ``(A Aᵀ + 1) ⊙ (B Bᵀ)`` and the stacked ``P Pᵀ``
are written once, and that the paths' own modules hold no matrix products."""
from __future__ import annotations

import pathlib
import re
from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.curvature import conv_stack, factored, materialized
from testing.calls import count_calls
from testing.distributed import free_port

KERNELS = {"materialized": materialized, "factored": factored}
PRODUCTS = ("gram", "jvp", "vjp", "woodbury")
SETTINGS = {"materialized": {"strategy": "materialize"}, "factored": {"strategy": "factor"}}
GROUP_FORM = {"materialized": "P", "factored": "IG"}
ROOT = pathlib.Path(tengrad_fx.__file__).parent


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of the calls of every stacked form's kernel, by ``"<module>.<function>"``."""
    return count_calls(monkeypatch, KERNELS, PRODUCTS)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _cnn() -> nn.Module:
    torch.manual_seed(0)  # two convolutions of one shape: one "conv" stack of two layers
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 3, padding=1), nn.Tanh(),
                         nn.Conv2d(3, 3, 3, padding=1), nn.Flatten(), nn.Linear(3 * 5 * 5, 3)).double()


def _train(opt_factory: Callable[[nn.Module], torch.optim.Optimizer], steps: int = 2,
           conv: bool = False) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, *((1, 5, 5) if conv else (5,)), generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=g)
    pm = tengrad_fx.prepare(_cnn() if conv else _mlp(), example_inputs=(x[:2],))
    opt = opt_factory(pm)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(pm(x), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in pm.parameters()]), opt


def _tengrad(**kw: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(pm: nn.Module) -> torch.optim.Optimizer:
        opt = tengrad_fx.TENGraD(pm, lr=0.1, damping=0.05, curvature_every=1, kl_clip=None, **kw)
        if kw.get("compile"):
            opt._fused.fn = None  # the fused function, eagerly
        return opt
    return make


def _only(calls: Counter, form: str) -> dict[str, int]:
    """The counts of ``form``'s kernels, after checking the other form's were not called."""
    other = next(f for f in KERNELS if f != form)
    assert not any(calls[f"{other}.{p}"] for p in PRODUCTS), dict(calls)
    return {p: calls[f"{form}.{p}"] for p in PRODUCTS}


@pytest.mark.parametrize("form", list(KERNELS))
@pytest.mark.parametrize("update_form", ["auto", "woodbury"])
def test_groups_path_calls_the_form_kernels(calls: Counter, monkeypatch, form: str, update_form: str) -> None:
    got, opt = _train(_tengrad(update_form=update_form, **SETTINGS[form]))
    assert {g.form for g in opt.curvature.groups} == {GROUP_FORM[form]}
    n = _only(calls, form)
    steps_groups = 2 * len(opt.curvature.groups)  # one Gram, J g and u per group and curvature step
    assert n["gram"] == steps_groups and n["jvp"] == steps_groups and n["woodbury"] == steps_groups, n
    monkeypatch.undo()  # the kernels as defined: the counted run changed nothing
    assert torch.equal(got, _train(_tengrad(update_form=update_form, **SETTINGS[form]))[0])


@pytest.mark.parametrize("form", list(KERNELS))
def test_fused_path_calls_the_form_kernels(calls: Counter, form: str) -> None:
    got, opt = _train(_tengrad(compile=True, update_form="woodbury", **SETTINGS[form]))
    assert opt.curvature.fused and not opt.curvature.groups  # the fused path ran (no groups cached)
    n = _only(calls, form)
    per_layer = 3 * 2  # three layers of different shapes, two curvature steps
    assert n["gram"] == per_layer and n["jvp"] == per_layer and n["vjp"] == per_layer, n
    assert n["woodbury"] == 0, n  # the fused update forms u from Jᵀc
    ref, _ = _train(_tengrad(update_form="woodbury", **SETTINGS[form]))
    assert (got - ref).abs().max().item() < 1e-12  # the modular path's u


@pytest.fixture
def one_rank() -> Any:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("form", list(KERNELS))
def test_gram_blocks_call_the_form_kernels(calls: Counter, one_rank: Any, form: str) -> None:
    from tengrad_fx.distributed import DistributedTENGraD

    got, opt = _train(lambda pm: DistributedTENGraD(pm, lr=0.1, damping=0.05, mode="gram-blocks", curvature_every=1,
                                                    kl_clip=None, **SETTINGS[form]))
    assert opt.distribution._n_gather == 0 and opt.curvature.groups, "every layer in gram-blocks"
    n = _only(calls, form)
    assert n["gram"] > 0 and n["jvp"] > 0 and n["vjp"] > 0, n  # the Gram, J_a g and J_aᵀ c_a
    ref, _ = _train(_tengrad(**SETTINGS[form]))
    assert (got - ref).abs().max().item() < 1e-12


@pytest.mark.parametrize("path", ["groups", "gram-blocks"])
def test_conv_stacks_call_their_kernels(monkeypatch, request, path: str) -> None:
    """Convolution stacks (no fused form) take their Gram, ``J g`` and ``Jᵀ c`` from
    :mod:`tengrad_fx.curvature.conv_stack` on both paths that have them."""
    calls = count_calls(monkeypatch, {"conv_stack": conv_stack}, ("gram", "jvp", "vjp"))
    if path == "groups":
        _, opt = _train(_tengrad(strategy="factor"), conv=True)
    else:
        from tengrad_fx.distributed import DistributedTENGraD

        request.getfixturevalue("one_rank")
        _, opt = _train(lambda pm: DistributedTENGraD(pm, lr=0.1, damping=0.05, mode="gram-blocks",
                                                      curvature_every=1, kl_clip=None, strategy="factor"), conv=True)
    stacks = [g for g in opt.curvature.groups if g.form == "conv"]
    assert [len(g.layers) for g in stacks] == [1, 2]
    n = {name: calls[f"conv_stack.{name}"] for name in ("gram", "jvp", "vjp")}
    assert n["gram"] == 2 * len(stacks) and n["jvp"] >= 2 * len(stacks) and n["vjp"] >= 2 * len(stacks), n


def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in ROOT.rglob("*.py")
            if "baselines" not in p.parts}


def test_factor_gram_and_stacked_gram_are_written_once() -> None:
    """``(A Aᵀ + 1) ⊙ (B Bᵀ)`` (as ``addcmul(BB, AA, BB)`` or ``(AA + 1) * BB``) only in
    ``curvature/factored.py``; a stack's ``P Pᵀ`` by ``bmm`` only in ``curvature/materialized.py``."""
    factor = re.compile(r"addcmul\((\w+), \w+, \1\)|\(\s*\w+ \+ 1(\.0)?\b[^()]*\)\s*\*")
    stacked = re.compile(r"bmm\((\w+), \1\.transpose\(1, 2\)")
    srcs = _sources()
    assert sorted(f for f, s in srcs.items() if factor.search(s)) == ["curvature/factored.py"]
    assert sorted(f for f, s in srcs.items() if stacked.search(s)) == ["curvature/materialized.py"]
    # the scans do find the idioms they look for
    assert factor.search("K = (AA + 1.0 if has_bias else AA) * (B @ B.T)")
    assert stacked.search("parts.append(torch.bmm(P, P.transpose(1, 2)))")


@pytest.mark.parametrize("path", ["optim/tengrad/group_forms.py", "optim/tengrad/fused_update.py",
                                  "distributed/gram_blocks.py"])
def test_paths_hold_no_products_of_their_own(path: str) -> None:
    """The groups, the fused update and gram-blocks compute no matrix product themselves."""
    src = _sources()[path]
    assert not re.search(r"\bbmm\(|baddbmm\(|addcmul\(|\bmm\(|\bmv\(|\w @ \w|\.T\b", src), path
