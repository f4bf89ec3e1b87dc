"""The bytes one rank puts on the wire in each collective of distributed TENGraD: one home
for the accounting that ``comm_bytes`` counts (:mod:`.records`, :mod:`.gram_blocks`,
:mod:`.share`) and the cost models use (:mod:`.plan`).

Each receiver is counted as if it got its own copy along a ring or pipeline, with ``W``
ranks and a payload of ``b`` bytes:

* ``gather`` to an owner: a non-owner sends its part once, the owner sends nothing;
* ring ``all_gather`` of ``b``-byte parts: every rank forwards ``(W−1)·b``;
* pipelined ``broadcast`` of ``b`` bytes: every rank sends them once;
* ring ``all_reduce`` of ``b`` bytes: every rank sends ``2·(W−1)/W·b``.

Per step a layer of ``n`` parameters (``es``-byte values, ``m`` samples per rank,
``M = W·m``) moves, on every rank:

* ``gather`` (owner placement): the owner's ``u``, :func:`gather_step_sent` ``= n·es``;
* ``gram-blocks``: the all-gather of the ``m``-vectors ``J_a g``, the broadcast of
  ``c`` (``M`` values) and the all-reduce of the ``Jᵀc`` partial sums,
  :func:`blocks_step_sent` ``= (W−1)·m·es + M·es + 2(W−1)/W·n·es``;
* ``local``: the all-reduce of the ranks' ``u``, :func:`all_reduce_sent` of ``n·es``.
"""
from __future__ import annotations

__all__ = ["gather_sent", "all_gather_sent", "broadcast_sent", "all_reduce_sent", "gather_step_sent",
           "blocks_step_sent"]


def gather_sent(part_bytes: float, to_self: bool) -> float:
    """Bytes a rank sends in a ``gather`` of its ``part_bytes`` (0 when it is the root)."""
    return 0.0 if to_self else float(part_bytes)


def all_gather_sent(part_bytes: float, world: int) -> float:
    """Bytes a rank sends in a ring ``all_gather`` of ``part_bytes`` per rank: ``(W−1)·b``."""
    return (world - 1) * float(part_bytes)


def broadcast_sent(nbytes: float) -> float:
    """Bytes a rank sends in a pipelined ``broadcast`` of ``nbytes``: each once."""
    return float(nbytes)


def all_reduce_sent(nbytes: float, world: int) -> float:
    """Bytes a rank sends in a ring ``all_reduce`` of ``nbytes``: ``2·(W−1)/W·b``."""
    return 2.0 * (world - 1) / world * float(nbytes)


def gather_step_sent(n: int, es: int = 4) -> float:
    """Bytes every rank sends per step for a ``gather`` layer of ``n`` parameters solved
    by one owner: the pipelined broadcast of its ``u`` (``n·es``)."""
    return broadcast_sent(n * es)


def blocks_step_sent(m: int, world: int, n: int, es: int = 4, width: int = 0) -> float:
    """Bytes every rank sends per step for a ``gram-blocks`` layer (``m`` rows per rank,
    ``n`` parameters, factor on one owner): the all-gather of ``J_a g`` (``m + width``
    values per rank; ``width``: the push-through probe's values of an empirical curvature
    step), the broadcast of ``c`` (``M = W·m`` values) and the all-reduce of ``Jᵀc`` (``n``)."""
    return (all_gather_sent((m + width) * es, world) + broadcast_sent(world * m * es)
            + all_reduce_sent(n * es, world))
