"""The options × strategies matrix (``tests/distributed/test_matrix.py``): TENGraD runs of
one option case on one model, in one process on the global batch (:func:`train_reference`)
or on ``W`` gloo ranks under a strategy (:func:`matrix_ranks`, through
:func:`testing.distributed.run_ranks`).

Models (float64, no dropout): "gpt2" (a one-block Hugging Face ``GPT2LMHeadModel``,
:mod:`testing.fsdp_conv1d`), "llama" (a one-block ``LlamaForCausalLM``: RMSNorm, rotary
positions, grouped keys and values) and "cnn" (two convolutions with BatchNorm in eval mode
and a Linear head, :mod:`testing.fsdp_workers`). The global batch has :data:`M` samples;
rank ``r`` of ``W`` takes samples ``r·M/W ...`` (the data-parallel rank is the global one,
HSDP included).

Strategies: ``"ddp-gather"`` and ``"ddp-gram-blocks"`` (``DDP(prepare(model))``,
``DistributedTENGraD(mode=...)``), ``"fsdp"`` (``fully_shard`` on each block and the
root, then ``prepare``) and ``"hsdp"`` (the same on a ``(2, W/2)`` replicate × shard mesh).

A case is a dict of TENGraD keywords over :data:`CORE`, with placeholders made real by
:func:`case_options`: ``params="two-groups"``, ``grad_scaler="scaler"``,
``distribution="single-process"``, and ``preset=name`` (with more keywords on top):
``make_optimizer("tengrad", ..., preset=name)``'s keywords.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fsdp_conv1d as transposed
from . import fsdp_workers
from .dist_workers import mc_step

__all__ = ["CORE", "M", "STEPS", "case_options", "train_reference", "matrix_ranks", "built", "built_or_refused",
           "per_job", "train"]

M, STEPS, SEQ, VOCAB = 4, 4, transposed.SEQ, transposed.VOCAB
CORE: dict[str, Any] = dict(lr=0.1, damping=0.05, momentum=0.5, weight_decay=1e-3, curvature_every=2, kl_clip=None)
"""The options every case starts from (a reuse step after each curvature step)."""


def make_model(kind: str) -> nn.Module:
    """The model ``kind`` (module docstring), seeded, float64."""
    if kind != "llama":
        return fsdp_workers.make_model(kind)
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transposed.Logits(transformers.LlamaForCausalLM(cfg)).double().eval()


def global_batch(kind: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of the global batch of step ``step``."""
    return fsdp_workers.global_batch("gpt2" if kind == "llama" else kind, M, step)


def _blocks(net: nn.Module) -> list[nn.Module]:
    """The modules ``fully_shard`` wraps before the root: the transformer blocks, or the
    convolutions and the head of the CNN."""
    names = ("GPT2Block", "LlamaDecoderLayer")
    return [mod for mod in net.modules() if type(mod).__name__ in names or isinstance(mod, (nn.Conv2d, nn.Linear))
            and kind_of(net) == "cnn"]


def kind_of(net: nn.Module) -> str:
    return "cnn" if isinstance(net, fsdp_workers.TinyCNN) else "lm"


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _reshard(net: nn.Module) -> None:
    """FSDP modules resharded (``prepare``'s check forward may leave the root's parameters
    gathered): the optimizer's param groups name the sharded ones."""
    from torch.distributed.fsdp import FSDPModule
    for mod in net.modules():
        if isinstance(mod, FSDPModule):
            mod.reshard()


def case_options(case: dict[str, Any], net: nn.Module) -> dict[str, Any]:
    """The TENGraD keywords of ``case`` on ``net`` (placeholders made real; module docstring)."""
    out = {**CORE, **case}
    preset = out.pop("preset", None)
    if preset is not None:
        from tengrad_fx.optim.registry import PAPER_FASHION, PRESETS, paper_settings
        out = {**paper_settings("tengrad", PAPER_FASHION), **PRESETS["tengrad"][preset], **case}
        out.pop("preset")
    if out.get("params") == "two-groups":  # the last two parameters: a group of their own lr and damping
        _reshard(net)
        named = list(net.parameters())
        out["params"] = [{"params": named[:-2]}, {"params": named[-2:], "lr": 0.05, "damping": 0.3}]
    if out.get("grad_scaler") == "scaler":
        out["grad_scaler"] = torch.amp.GradScaler("cpu", init_scale=16.0)
    if out.get("distribution") == "single-process":
        from tengrad_fx.optim.tengrad.distribution import SingleProcess
        out["distribution"] = SingleProcess()
    return out


def _params(net: nn.Module) -> dict[str, torch.Tensor]:
    return fsdp_workers.full_params(net)


def train(opt: Any, fwd: nn.Module, net: nn.Module, kind: str, part: tuple[int, int],
          steps: range = range(STEPS)) -> dict[str, Any]:
    """:data:`STEPS` steps (``fwd``: the model to call, ``net``: its parameters' names) on
    part ``part = (r, W)`` of each global batch (``steps``: their indices): the parameters
    before and after, the MC targets drawn (None where none), the curvature steps taken."""
    r, world = part
    m = M // world
    scaler = opt.grad_scaler
    start, drawn = _params(net), []
    for k in steps:
        x, y = global_batch(kind, k)
        x, y = x[r * m:(r + 1) * m], y[r * m:(r + 1) * m]
        out = fwd(x)
        loss = _loss(out, y)
        with warnings.catch_warnings():  # sampled at every position: what these tests mean
            warnings.filterwarnings("ignore", ".*the MC Fisher samples labels at every position")
            drawn.append(mc_step(opt, out, loss, scaler))
    return {"start": start, "end": _params(net), "targets": drawn, "curvature_steps": opt.curvature_steps}


def _prepared(kind: str, example: bool) -> nn.Module:
    import tengrad_fx
    ex = (global_batch(kind, 0)[0][:2],) if example else None
    return fsdp_workers.frozen_statistics(tengrad_fx.prepare(make_model(kind), example_inputs=ex))


def train_reference(kind: str, case: dict[str, Any]) -> dict[str, Any]:
    """Single-process TENGraD with ``case``'s options on the global batches, drawing its own
    MC labels and position rows from its generator seeded as the distributed one (0). A
    preset case is built by ``make_optimizer``, as a user builds it."""
    import tengrad_fx
    from tengrad_fx.optim.registry import make_optimizer
    net = _prepared(kind, kind != "cnn")
    kw = case_options(case, net)
    if "preset" in case:
        more = {k: v for k, v in kw.items() if k in case and k != "preset"}
        opt = make_optimizer("tengrad", net, preset=case["preset"], **more)
    else:
        opt = tengrad_fx.TENGraD(net, **kw)
    opt.seed_mc(0)
    return train(opt, net, net, kind, (0, 1))


def built(kind: str, strategy: str, world: int, case: dict[str, Any]) -> tuple[Any, nn.Module, nn.Module]:
    """``(optimizer, model to call, model)`` of ``strategy`` on this rank."""
    import tengrad_fx
    from tengrad_fx.distributed import DistributedTENGraD
    if strategy.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = _prepared(kind, kind != "cnn")
        ddp = DDP(net)
        mode = strategy.split("-", 1)[1]
        opt = DistributedTENGraD(ddp, mode=mode, placement="owner", **case_options(case, net))
        return opt, ddp, net
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if strategy == "hsdp" \
        else init_device_mesh("cpu", (world,))
    net = make_model(kind)
    for mod in _blocks(net):
        fully_shard(mod, mesh=mesh)
    fully_shard(net, mesh=mesh)
    net = fsdp_workers.frozen_statistics(tengrad_fx.prepare(net, example_inputs=(global_batch(kind, 0)[0][:2],)))
    opt = DistributedTENGraD(net, **case_options(case, net))
    return opt, net, net


def built_or_refused(kind: str, strategy: str, world: int, case: dict[str, Any]) -> Any:
    """:func:`built`'s triple, or ``{"construction": message}`` where it raised a ``ValueError``."""
    try:
        return built(kind, strategy, world, case)
    except ValueError as exc:
        return {"construction": f"{type(exc).__name__}: {exc}"}


def matrix_ranks(rank: int, world: int, strategies: list[str], jobs: dict[str, tuple[str, dict[str, Any]]]
                 ) -> dict[str, dict[str, dict[str, Any]]]:
    """On each rank: every job ``name -> (model, case)`` under each of ``strategies``; per
    strategy and job the :func:`train` result, or ``{"construction": message}`` (a
    ``ValueError`` at construction) or ``{"step": traceback}`` (an error while training)."""
    return {strategy: _strategy_runs(rank, world, strategy, jobs) for strategy in strategies}


def per_job(world: int, strategy: str, jobs: dict[str, tuple[str, dict[str, Any]]],
            run: Callable[[str, str, dict[str, Any], tuple[Any, nn.Module, nn.Module]], dict[str, Any]]
            ) -> dict[str, dict[str, Any]]:
    """``{name: run(name, model, case, built(model, strategy, world, case))}`` for every job
    ``name -> (model, case)``, or ``{"construction": message}`` where building it raised a ``ValueError``."""
    out: dict[str, dict[str, Any]] = {}
    for name, (kind, case) in jobs.items():
        made = built_or_refused(kind, strategy, world, case)
        out[name] = made if isinstance(made, dict) else run(name, kind, case, made)
    return out


def _strategy_runs(rank: int, world: int, strategy: str, jobs: dict[str, tuple[str, dict[str, Any]]]
                   ) -> dict[str, dict[str, Any]]:
    import traceback

    def run(name: str, kind: str, case: dict[str, Any], made: tuple[Any, nn.Module, nn.Module]) -> dict[str, Any]:
        try:
            return train(*made, kind, (rank, world))
        except Exception:  # reported by the test with the case's name
            return {"step": traceback.format_exc()}
    return per_job(world, strategy, jobs, run)
