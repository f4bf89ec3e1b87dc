"""Model inputs as pytrees: the batch size of a call and inputs resized to another batch.

Containers are those of ``torch.utils._pytree`` (tuples, lists, dicts, namedtuples,
registered dataclasses) plus unregistered dataclasses (walked field by field). The batch
is the leading dim of the first tensor leaf.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
import torch.utils._pytree as pytree

__all__ = ["tensor_leaves", "map_tensors", "leading_dim", "resize_batch", "as_call", "run_call"]

Call = list  # [args: tuple, kwargs: dict]: one forward call's inputs, itself a pytree


def as_call(example_inputs: Any) -> Call:
    """``[args, kwargs]`` of ``model(*args, **kwargs)`` from ``example_inputs`` given as the
    model is called: a tuple/list of positional inputs, a dict of keyword inputs (e.g. a
    Hugging Face batch), or ``(args, kwargs)`` (a tuple/list and a dict); anything else is
    the one positional input."""
    if isinstance(example_inputs, dict):
        return [(), dict(example_inputs)]
    if (isinstance(example_inputs, (tuple, list)) and len(example_inputs) == 2
            and isinstance(example_inputs[0], (tuple, list)) and isinstance(example_inputs[1], dict)):
        return [tuple(example_inputs[0]), dict(example_inputs[1])]
    if isinstance(example_inputs, (tuple, list)):
        return [tuple(example_inputs), {}]
    return [(example_inputs,), {}]


def run_call(model: Callable[..., Any], call: Call) -> Any:
    """``model(*args, **kwargs)`` of a :func:`as_call` call."""
    return model(*call[0], **call[1])


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """Tensor leaves of nested tuples/lists/dicts/namedtuples (``torch.utils._pytree``) and
    dataclasses, in order."""
    out: list[torch.Tensor] = []

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for f in dataclasses.fields(leaf):
                pytree.tree_map(visit, getattr(leaf, f.name))
        return leaf

    pytree.tree_map(visit, tree)
    return out


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor leaf replaced by ``fn(leaf)`` (containers as in
    :func:`tensor_leaves`; a dataclass is rebuilt with ``dataclasses.replace``)."""

    def visit(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            return dataclasses.replace(leaf, **{f.name: pytree.tree_map(visit, getattr(leaf, f.name))
                                                for f in dataclasses.fields(leaf) if f.init})
        return leaf

    return pytree.tree_map(visit, tree)


def leading_dim(*inputs: Any) -> Optional[int]:
    """The batch size of a forward call: the leading dim of its first tensor leaf."""
    for t in tensor_leaves(inputs):
        if t.dim() > 0:
            return t.shape[0]
    return None


def resize_batch(inputs: Sequence[Any], n: int) -> list[Any]:
    """``inputs`` at batch ``n``: every tensor leaf whose leading dim is the batch (that of
    the first tensor leaf) becomes its first sample repeated ``n`` times; other leaves
    (constants, masks of another size, non-tensors) are passed unchanged."""
    batch = leading_dim(*inputs)

    def resize(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 0 and t.shape[0] == batch:
            return t[:1].repeat(n, *([1] * (t.dim() - 1)))
        return t

    return [map_tensors(resize, x) for x in inputs]
