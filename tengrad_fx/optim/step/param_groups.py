"""torch.optim parameter groups for TENGraD and the baselines.

Every group carries ``lr``, ``damping``, ``momentum`` and ``weight_decay`` (a key left out
takes the constructor's value, as in torch.optim). Per parameter ``p`` of group ``G``::

    d = ν·u_p + λ_G·w_p,   buf = μ_G·buf + d,   w_p ← w_p − lr_G·buf

with ``u_p`` the parameter's slice of its layer's preconditioned update (``u_p = g_p``
for fallback parameters). A covered layer stays one curvature block whatever groups
its weight and bias are in; its damping is the group of its weight's. With one ``lr``
over all groups the KL clip is ``ν = min(1, sqrt(kl_clip / (lr²·Σ u·g)))``; with several,
``lr²·Σ u·g`` becomes ``Σ_G lr_G²·Σ_{p∈G} u_p·g_p``. A parameter in no group is not
updated, and a layer whose weight is in no group takes no curvature.

The damping handed to the subclasses (:data:`Damping`) is one float when every group
has the same, else the tuple of the groups' dampings (:func:`layer_damping` picks a
layer's).
"""
from __future__ import annotations

import warnings
from typing import Any, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor

from ...curvature.layer import CoveredLayer, covered_layers
from .checks import check_nonneg, check_positive, check_unit
from .update import update_dot

__all__ = ["Damping", "FrozenWatch", "optimizer_params", "check_group", "group_params", "group_index", "groups_damping",
           "layer_damping", "layer_dampings", "grouped_layers", "in_groups", "same_lr", "weighted_update_dot"]

Damping = Union[float, tuple[float, ...]]
"""One damping for every layer, or one per param group (group order)."""


def optimizer_params(model: torch.nn.Module, params: Optional[Iterable[Any]], owner: str, first: int = 0) -> list[Any]:
    """The constructor's ``params``: by default every parameter of ``model`` that requires
    grad (one group); else a list of parameters or of group dicts (torch.optim's format),
    each parameter one of ``model``'s (``ValueError`` naming the stray one otherwise;
    ``first``: the index of the first group, for the message)."""
    if params is None:
        return [p for p in model.parameters() if p.requires_grad]
    if isinstance(params, Tensor):
        raise TypeError(f"{owner}: params must be an iterable of Parameters or of param group dicts, got a Tensor")
    items = list(params)
    mine = {id(p) for p in model.parameters()}
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    for i, grp in enumerate(groups):
        ps = grp["params"] if isinstance(grp, dict) else grp
        for p in ([ps] if isinstance(ps, Tensor) else list(ps)):
            if id(p) not in mine:
                raise ValueError(f"{owner}: a tensor of shape {tuple(p.shape)} in params (group {first + i}) is not a "
                                 "parameter of the prepared model; pass the model's own parameters")
    return items


def check_group(group: dict[str, Any], index: int, owner: str) -> None:
    """``ValueError`` naming the group and key for a bad ``lr``/``damping``/``momentum``/``weight_decay``."""
    where = f"{owner} param group {index}: "
    check_nonneg(where + "lr", group["lr"])
    check_positive(where + "damping", group["damping"])
    check_unit(where + "momentum", group["momentum"])
    check_nonneg(where + "weight_decay", group["weight_decay"])


def group_params(groups: list[dict[str, Any]]) -> list[Tensor]:
    """Every group's parameters, in group order (torch's state-dict order)."""
    return [p for g in groups for p in g["params"]] if len(groups) > 1 else list(groups[0]["params"])


def group_index(groups: list[dict[str, Any]]) -> dict[Tensor, int]:
    """``{param: index of its group}``."""
    return {p: i for i, g in enumerate(groups) for p in g["params"]}


def groups_damping(groups: list[dict[str, Any]], owner: str) -> Damping:
    """The step's :data:`Damping` (each group's checked ``> 0``)."""
    if len(groups) == 1:
        check_positive("damping", groups[0]["damping"])
        return groups[0]["damping"]
    for i, g in enumerate(groups):
        check_positive(f"{owner} param group {i}: damping", g["damping"])
    first = groups[0]["damping"]
    return first if all(g["damping"] == first for g in groups) else tuple(g["damping"] for g in groups)


def layer_damping(damping: Damping, weight: Tensor, index: Optional[dict[Tensor, int]], name: str) -> float:
    """The damping of the layer ``name`` whose weight is ``weight``: ``damping`` itself when
    it is one float, else its group's entry (``index``: :func:`group_index`)."""
    if not isinstance(damping, tuple):
        return damping
    assert index is not None
    if weight not in index:
        raise ValueError(f"layer '{name}': its weight is in no param group, so it has no damping; add it to a "
                         "group (opt.add_param_group) or build the optimizer over it")
    return damping[index[weight]]


def layer_dampings(damping: Damping, groups: list[dict[str, Any]], layers: list[CoveredLayer]) -> Any:
    """``damping`` when it is one float, else the ``[len(layers)]`` float64 tensor of each
    layer's (its weight's group's)."""
    if not isinstance(damping, tuple):
        return damping
    index = group_index(groups)
    return torch.tensor([layer_damping(damping, lay.weight, index, lay.name) for lay in layers], dtype=torch.float64)


def grouped_layers(model: torch.nn.Module, groups: list[dict[str, Any]]) -> list[CoveredLayer]:
    """The covered layers of ``model`` whose weight is in one of ``groups``."""
    index = group_index(groups)
    return [lay for lay in covered_layers(model) if lay.weight in index]


def in_groups(updates: dict[Tensor, Tensor], index: dict[Tensor, int]) -> dict[Tensor, Tensor]:
    """``updates`` of the parameters in some group (the others are not updated)."""
    return {p: u for p, u in updates.items() if p in index}


def same_lr(groups: list[dict[str, Any]]) -> bool:
    """Do all groups have the first group's ``lr`` (the KL clip then takes ``lr²·Σ u·g``)?"""
    return all(g["lr"] == groups[0]["lr"] for g in groups)


def weighted_update_dot(updates: dict[Tensor, Tensor], groups: list[dict[str, Any]],
                        lrs: Sequence[float | Tensor]) -> Optional[Tensor]:
    """``Σ_G lr_G²·Σ_{p∈G} u_p·g_p`` over the preconditioned parameters (a device scalar;
    None without updates): the KL clip's ``lr²·Σ u·g`` when the groups' ``lr`` differ.
    ``lrs``: each group's lr (floats, or 0-d device tensors)."""
    total: Optional[Tensor] = None
    for g, lr in zip(groups, lrs):
        mine = {p: updates[p] for p in g["params"] if p in updates}
        if mine:
            dot = update_dot(mine)
            part = dot * ((lr * lr).to(dot.dtype) if isinstance(lr, Tensor) else lr * lr)
            total = part if total is None else total + part
    return total


class FrozenWatch:
    """The parameters that were frozen (``requires_grad=False``) when an optimizer was built.

    They are in none of its param groups, so unfreezing them later does not make the optimizer
    update them; :meth:`check` warns once, at the first step after that happened (unless
    they were added by ``add_param_group``), that a new optimizer is needed (``prepare`` need not be redone: capture and
    ``covered_layers`` read ``requires_grad`` at each call). Host attributes only."""

    def __init__(self, model: torch.nn.Module, owner: str):
        self.frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.owner = owner
        self.warned = False

    def check(self, groups: list[dict[str, Any]]) -> None:
        if self.warned or not self.frozen:
            return
        thawed = [(n, p) for n, p in self.frozen if p.requires_grad]
        if thawed:  # those added to a group since (add_param_group) are updated
            grouped = {id(p) for g in groups for p in g["params"]}
            thawed = [(n, p) for n, p in thawed if id(p) not in grouped]
        if thawed:
            names = [n for n, _ in thawed]
            warnings.warn(f"{self.owner}: {names} were frozen when the optimizer was built and are now "
                          "trainable, but they are in none of its param groups and are not updated: build a "
                          "new optimizer or opt.add_param_group(...) (no new prepare() is needed)", RuntimeWarning)
            self.warned = True
