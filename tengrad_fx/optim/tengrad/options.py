"""TENGraD's options as checked and resolved: :class:`Execution` (how the update is computed:
same maths, other speed/memory; ``opt.execution``, built from the flat keywords of the same
names), the range checks of the other keywords, and what the options imply (the ``J``
budget, CUDA graphs). Each option has one spelling: :mod:`.spellings`."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import torch

from ..step.checks import check_choice, check_nonneg, check_positive, check_unit
from .position_rows import check_position_rows
from .subsample import check_curvature_samples

__all__ = ["Execution", "check_options", "built_options", "jacobian_budget_bytes", "use_cuda_graph"]


@dataclass(frozen=True)
class Execution:
    """How TENGraD computes its update: :class:`~.tengrad.TENGraD`'s keywords of the same names
    as resolved (``opt.execution``; as a constructor argument, ``execution=``, deprecated).

    Attributes:
        strategy: Gram strategy for all layers: ``"auto"``, ``"factor"``, ``"materialize"``.
        jacobian_budget_mb: MiB for the ``J`` kept between steps (None: each layer's own bound).
        compile: the fused update under ``torch.compile`` (True, or a backend name / callable).
        cuda_graph: reuse steps as replayed CUDA graphs (None: on for CUDA parameters).
        gram_tf32: curvature steps' float32 Grams with TF32 on CUDA.
        solve_dtype: dtype of the ``m × m`` Cholesky (None: the parameters').
    """

    strategy: Literal["auto", "factor", "materialize"] = "auto"
    jacobian_budget_mb: Optional[float] = None
    compile: Any = False
    cuda_graph: Optional[bool] = None
    gram_tf32: bool = False
    solve_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        check_choice("strategy", self.strategy, ("auto", "factor", "materialize"))
        if self.jacobian_budget_mb is not None:
            check_nonneg("jacobian_budget_mb", self.jacobian_budget_mb)


def built_options(init: Callable[..., Any], args: dict[str, Any]) -> dict[str, Any]:
    """Every argument of the constructor ``init`` but ``self`` and ``model``, by name, with
    the value the optimizer runs with (``args``: the constructor's ``locals()``). What a
    distribution's ``check`` reads, so no option escapes it."""
    return {n: args[n] for n in inspect.signature(init).parameters if n not in ("self", "model")}


def jacobian_budget_bytes(ex: Execution) -> Optional[float]:
    """The bytes all kept ``J`` may take: ``jacobian_budget_mb``, or with
    ``strategy="materialize"`` (every layer asked for as ``J``) a flat 1024 MiB; None: no
    shared budget (each layer's own bound)."""
    budget = ex.jacobian_budget_mb
    if budget is None and ex.strategy == "materialize":
        budget = 1024.0
    return None if budget is None else budget * 2**20


def use_cuda_graph(ex: Execution, eigh: bool, capturable: bool, on_cuda: bool) -> bool:
    """``ex.cuda_graph``, or its default (None): on for parameters on a CUDA device (``on_cuda``)
    where the distribution allows it (``capturable``), off under an eigh polar factor (``eigh``:
    ``orthogonalize=True``, whose cuSOLVER call cannot be captured; ``cuda_graph=True`` there
    is a ``ValueError``)."""
    if ex.cuda_graph and eigh:
        raise ValueError("TENGraD(orthogonalize=True, cuda_graph=True): the polar factor's eigendecomposition "
                         "(cuSOLVER) cannot be captured in a CUDA graph; pass cuda_graph=False or leave it None "
                         "(off with orthogonalize), or orthogonalize='newton-schulz' (capturable)")
    if ex.cuda_graph is None:
        return not eigh and capturable and on_cuda
    return bool(ex.cuda_graph)


def check_options(*, lr: float, damping: float, momentum: float, weight_decay: float, fisher: str, mc_loss: str,
                  kl_clip: Optional[float], update_form: str, curvature_samples: Optional[int],
                  position_rows: Optional[int]) -> None:
    """``ValueError`` naming the first of TENGraD's keywords of these names out of its range,
    or a pair of them that do not go together."""
    check_nonneg("lr", lr)
    check_positive("damping", damping)
    check_unit("momentum", momentum)
    check_nonneg("weight_decay", weight_decay)
    check_curvature_samples(curvature_samples)
    check_position_rows(position_rows)
    if position_rows is not None and (curvature_samples is not None or fisher == "gauss-newton"):
        raise ValueError("position_rows draws rows of the whole batch's records: leave curvature_samples None "
                         "and use fisher='empirical' or 'mc' with it")
    check_choice("fisher", fisher, ("empirical", "mc", "gauss-newton"))
    check_choice("mc_loss", mc_loss, ("cross_entropy", "mse"))
    if kl_clip is not None:
        check_positive("kl_clip", kl_clip)
    check_choice("update_form", update_form, ("auto", "woodbury"))
