"""The collectives of distributed TENGraD, only through ``torch.distributed``.

Everything here works the same on gloo (CPU tensors) and NCCL (CUDA tensors): tensors
are sent as contiguous flat buckets (one per ``(rank, dtype)``), the ops are the plain
``gather`` / ``all_gather`` / ``broadcast`` / ``all_reduce`` with ``async_op=True`` where
several can be in flight at once, and nothing is copied to the host except the small
per-curvature-step metadata exchanged by :func:`all_gather_meta`.

Every collective goes through :func:`collective`, which turns a failure (a peer that
raised and closed its connection, a process-group timeout) into a
:class:`DistributedStepError` that names the rank, the operation and what to do, instead
of a bare backend message; the wait is bounded by the process group's ``timeout``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DistributedStepError", "collective", "nccl_backend", "all_gather_meta", "all_ok", "all_sum", "Bucket",
           "pack", "unpack", "gather_buckets", "start_broadcasts", "wait_all", "broadcast_buckets"]

T = TypeVar("T")


class DistributedStepError(RuntimeError):
    """A collective of a distributed TENGraD step failed (another rank raised, died or
    timed out)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def collective(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` (a collective, or waits on its handles); a backend failure becomes a
    :class:`DistributedStepError` naming ``what``."""
    try:
        return fn()
    except DistributedStepError:
        raise
    except (RuntimeError, ValueError) as exc:  # DistBackendError subclasses RuntimeError
        raise DistributedStepError(
            f"DistributedTENGraD (rank {_rank()}): {what} failed: {type(exc).__name__}: {exc}. Another rank has "
            "most likely raised, died or timed out (see its own error); the wait is bounded by the process "
            "group's timeout (init_process_group(timeout=...)).") from exc


def nccl_backend() -> bool:
    """Is the default process group's backend NCCL (alone, or NCCL for CUDA tensors)?"""
    return "nccl" in str(dist.get_backend()).lower()


def all_gather_meta(obj: Any, what: str) -> list[Any]:
    """``[obj of rank 0, obj of rank 1, ...]`` (small picklable objects; a host exchange)."""
    out: list[Any] = [None] * dist.get_world_size()
    collective(what, lambda: dist.all_gather_object(out, obj))
    return out


def all_ok(flag: Tensor) -> Tensor:
    """The logical AND over all ranks of a device ``bool`` scalar (one ``all_reduce``
    with ``MIN``, no host read): a step skipped on one rank is skipped on every rank."""
    t = flag.to(torch.int32).reshape(1)
    collective("all_reduce of the step's finite flag", lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN))
    return t[0].bool()


class Bucket:
    """Tensors of one ``(rank, dtype)`` sent as one flat buffer: ``shapes`` in order."""

    def __init__(self, rank: int, dtype: torch.dtype, device: torch.device):
        self.rank, self.dtype, self.device = rank, dtype, device
        self.shapes: list[torch.Size] = []
        self.keys: list[Any] = []

    def add(self, key: Any, shape: torch.Size) -> None:
        self.keys.append(key)
        self.shapes.append(torch.Size(shape))

    @property
    def numel(self) -> int:
        return sum(s.numel() for s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def pack(ts: Sequence[Tensor], bucket: Bucket) -> Tensor:
    """One contiguous flat buffer of ``ts`` (in ``bucket`` order and dtype)."""
    if not ts:
        return torch.empty(0, dtype=bucket.dtype, device=bucket.device)
    return torch.cat([t.reshape(-1).to(bucket.dtype) for t in ts])


def unpack(flat: Tensor, bucket: Bucket, shapes: Optional[list[torch.Size]] = None) -> list[Tensor]:
    """Views of ``flat`` with ``bucket``'s shapes (or another rank's ``shapes`` of its keys)."""
    out, off = [], 0
    for s in bucket.shapes if shapes is None else shapes:
        out.append(flat[off: off + s.numel()].view(s))
        off += s.numel()
    return out


def gather_buckets(buckets: list[Bucket], local: dict[int, Tensor],
                   sizes: Optional[list[list[int]]] = None) -> dict[int, Optional[list[Tensor]]]:
    """For each bucket ``b`` (index ``i``, ``local[i]`` this rank's flat part): the list of
    every rank's flat part, on ``b.rank`` (``gather``) or on all ranks when ``b.rank`` is
    negative (``all_gather``); None where this rank receives nothing. All ops in flight
    at once. ``sizes[i]``: each rank's part's length where they differ (the parts then
    travel point to point, :func:`_uneven`; default: all of ``local[i]``'s)."""
    world, me = dist.get_world_size(), _rank()
    recv: dict[int, Optional[list[Tensor]]] = {}
    works: list[Any] = []
    p2p: list[Any] = []
    for i, b in enumerate(buckets):
        mine = local[i]
        replicate = b.rank < 0
        if sizes is not None and len(set(sizes[i])) > 1:
            recv[i] = _uneven(mine, sizes[i], b.rank, p2p, i)
            continue
        if replicate or b.rank == me:
            parts = [torch.empty_like(mine) for _ in range(world)]
            recv[i] = parts
        else:
            parts = None
            recv[i] = None
        if replicate:
            works.append(collective("all_gather of curvature records",
                                    lambda p=parts, t=mine: dist.all_gather(p, t, async_op=True)))  # type: ignore[misc]
        else:
            works.append(collective("gather of curvature records to their owner",
                                    lambda p=parts, t=mine, r=b.rank: dist.gather(t, p, dst=r, async_op=True)))  # type: ignore[misc]
    if p2p:  # one batch for every uneven bucket
        works.extend(collective("sends of curvature records", lambda: dist.batch_isend_irecv(p2p)))
    for w in works:
        collective("waiting for the curvature records", w.wait)
    return recv


def _uneven(mine: Tensor, sizes: list[int], root: int, ops: list[Any], tag: int) -> Optional[list[Tensor]]:
    """A ``gather`` to ``root`` (every rank when negative) of parts of the lengths ``sizes``
    (by rank), as sends and receives of the non-empty parts (``dist.P2POp`` s added to
    ``ops``, with ``tag``). Returns the parts (filled once ``ops`` ran) where this rank receives them, else None."""
    me = _rank()
    if root < 0 or root == me:
        parts = [mine if q == me else mine.new_empty(n) for q, n in enumerate(sizes)]
        ops += [dist.P2POp(dist.irecv, t, q, tag=tag) for q, t in enumerate(parts) if q != me and sizes[q]]
    if mine.numel():
        to = [q for q in range(len(sizes)) if q != me] if root < 0 else [root] if root != me else []
        ops += [dist.P2POp(dist.isend, mine, q, tag=tag) for q in to]
    return parts if root < 0 or root == me else None


def all_sum(flat: Tensor) -> None:
    """``flat`` summed over all ranks, in place (one ``all_reduce``)."""
    collective("all_reduce of the local-Fisher updates", lambda: dist.all_reduce(flat))


def start_broadcasts(flats: list[Tensor], buckets: list[Bucket], what: str = "preconditioned gradients") -> list[Any]:
    """Start broadcasting each ``flats[i]`` in place from ``buckets[i].rank`` (async, all
    in flight at once); :func:`wait_all` the returned handles before reading ``flats``."""
    return [collective(f"broadcast of {what}", lambda t=t, r=b.rank: dist.broadcast(t, src=r, async_op=True))  # type: ignore[misc]
            for t, b in zip(flats, buckets)]


def wait_all(works: list[Any], what: str = "preconditioned gradients") -> None:
    """Wait for the handles of async collectives."""
    for w in works:
        collective(f"waiting for the {what}", w.wait)


def broadcast_buckets(flats: list[Tensor], buckets: list[Bucket], what: str = "preconditioned gradients") -> None:
    """Broadcast each ``flats[i]`` in place from ``buckets[i].rank``; all in flight at once."""
    wait_all(start_broadcasts(flats, buckets, what), what)
