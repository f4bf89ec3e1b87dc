"""The polar factor and the graft under FSDP2 in tests: "mlp", four Linear layers of odd
widths (uneven row shards on 2 ranks: 7 → 4 + 3, 9 → 5 + 4, 5 → 3 + 2), built by
:func:`testing.fsdp_workers.make_model`; :func:`param_groups` (a group of the layers
``cfg["no_polar"]`` names that keeps its updates, ``"orthogonalize": False``); and
:func:`counting_polar`, which records the matrices this process orthogonalizes.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

__all__ = ["MLP", "batch", "param_groups", "counting_polar"]

D_IN, CLASSES = 6, 5


class MLP(nn.Module):
    """``[m, 6]`` → Linear 7 → tanh → Linear 9 → tanh → Linear 9 → tanh → Linear 5."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D_IN, 7), nn.Linear(7, 9)
        self.fc3, self.fc4 = nn.Linear(9, 9), nn.Linear(9, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return self.fc4(torch.tanh(self.fc3(x)))


def batch(M: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``[M, 6]`` and class targets ``[M]``."""
    return torch.randn(M, D_IN, generator=g, dtype=torch.float64), torch.randint(0, CLASSES, (M,), generator=g)


def param_groups(net: nn.Module, cfg: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """Two groups when ``cfg["no_polar"]`` names layers (theirs with ``"orthogonalize": False``),
    else None (one group)."""
    names = cfg.get("no_polar")
    if not names:
        return None
    from torch.distributed.fsdp import FSDPModule
    for mod in net.modules():  # prepare's check forward may leave the root's parameters gathered
        if isinstance(mod, FSDPModule):
            mod.reshard()
    out = [(n, p) for n, p in net.named_parameters() if n.split(".")[0] in names]
    return [{"params": [p for n, p in net.named_parameters() if n.split(".")[0] not in names]},
            {"params": [p for _, p in out], "orthogonalize": False}]


@contextlib.contextmanager
def counting_polar() -> Iterator[list[tuple[int, int]]]:
    """Within: every matrix ``[a, b]`` that ``tengrad_fx.solve.polar_factor`` or
    ``newton_schulz_polar`` is called on here (a batch counts each of its matrices) is
    appended to the yielded list."""
    from tengrad_fx import solve
    calls: list[tuple[int, int]] = []
    saved = solve.polar_factor, solve.newton_schulz_polar

    def count(fn: Any) -> Any:
        def wrapped(m: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls.extend([(int(m.shape[-2]), int(m.shape[-1]))] * (m.shape[0] if m.ndim == 3 else 1))
            return fn(m, *args, **kwargs)
        return wrapped

    solve.polar_factor, solve.newton_schulz_polar = count(saved[0]), count(saved[1])
    try:
        yield calls
    finally:
        solve.polar_factor, solve.newton_schulz_polar = saved


PROBE_SHAPES = [((9, 7), torch.float64), ((9, 7), torch.float64), ((3, 11), torch.float64), ((1, 5), torch.float64),
                ((6, 2, 2), torch.float32), ((12, 12), torch.float64)]


def polar_probe(rank: int, world: int) -> dict[str, Any]:
    """On this rank: :func:`tengrad_fx.distributed.fsdp_shaping.owner_polar` of seeded
    updates of :data:`PROBE_SHAPES` (weights sharded ``Shard(0)`` on a 1-D mesh: a 1-row
    weight leaves rank 1 none; two weights of one shape; a float32 one) per method, and
    whether this rank's rows equal, bit for bit, those of the single-process function
    (:func:`tengrad_fx.optim.tengrad.graft.orthogonalize_updates`) on the whole updates;
    the matrices it orthogonalized (:func:`counting_polar`), the owners and the bytes it
    sent per weight."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from tengrad_fx.distributed.fsdp_shaping import owner_polar
    from tengrad_fx.optim.tengrad.graft import orthogonalize_updates
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(7)
    fulls = [torch.randn(*shape, generator=g, dtype=dtype) for shape, dtype in PROBE_SHAPES]
    weights = [distribute_tensor(torch.zeros_like(u), mesh, [Shard(0)]) for u in fulls]
    out: dict[str, Any] = {}
    for method in ("eigh", "newton-schulz"):
        local = {p: u[slice(*_rows(p))].clone() for p, u in zip(weights, fulls)}
        sent: dict[int, int] = {}
        with counting_polar() as calls:
            got, owners = owner_polar(local, weights, method, dist.group.WORLD, rank, world,
                                      lambda p, n, sent=sent: sent.update({_index(weights, p): n}))
        ref = orthogonalize_updates(dict(zip(weights, fulls)), method)
        out[method] = {"equal": [torch.equal(got[p], ref[p][slice(*_rows(p))]) for p in weights],
                       "calls": calls, "owners": owners, "sent": [sent[i] for i in range(len(weights))]}
    return out


def _index(ts: list[torch.Tensor], t: torch.Tensor) -> int:
    return next(i for i, x in enumerate(ts) if x is t)


def _rows(p: torch.Tensor) -> tuple[int, int]:
    from tengrad_fx.distributed.fsdp_rows import row_range
    return row_range(p)
