"""``--distributed`` for ``tengrad_fx.cli.train``: the process group, this rank's device, its part
of each global batch, and which rank writes.

Launch (one process per rank; ``torchrun`` sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``)::

    torchrun --nproc_per_node=N -m tengrad_fx.cli.train --distributed [--batch-size B] ...

* ``--batch-size`` is the GLOBAL batch ``B``; it must be a multiple of the world size
  ``W``, and each rank trains on ``B / W`` rows of every global batch: every rank draws
  the same shuffled global batches (same data generator, so the same order for any
  ``W``) and keeps its own contiguous block (``rank·B/W … (rank+1)·B/W``) — the
  ``DistributedSampler`` equivalent for the in-memory datasets. The last incomplete
  global batch of an epoch is dropped, so every rank's part has ``B / W`` rows.
* The model is ``DDP(prepare(model))``; TENGraD is
  :class:`tengrad_fx.distributed.DistributedTENGraD` (global-batch Fisher); SGD is plain
  ``torch.optim.SGD`` under DDP. Other optimizers are refused.
* Logs, ``config.json``, checkpoints, ``summary.json``, the plot, tqdm and prints come
  from rank 0 only; every rank evaluates the (identical) model on the test set.
  The logged loss and accuracy are the global batch's (one ``all_reduce`` per step).
* A checkpoint holds the model, the optimizer state (no per-owner curvature) and the
  data position in global batches, so ``--resume`` continues with the same or another
  world size (same ``--batch-size``), also without ``--distributed`` (one process).
* Backend: NCCL when the device is CUDA (``cuda:LOCAL_RANK``), gloo on CPUs.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

__all__ = ["DistRun", "check_distributed", "leave_if_destroyed"]

_DESTROYED = False  # set once close() destroyed the process group


class DistRun:
    """This process's rank in the job and the helpers the training loop needs."""

    def __init__(self, device: str):
        self.owns_group = not dist.is_initialized()  # created here (torchrun): destroyed by close()
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise ValueError("--distributed: RANK/WORLD_SIZE are not set; launch with "
                                 "torchrun --nproc_per_node=N -m tengrad_fx.cli.train --distributed ...")
            use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
            dist.init_process_group("nccl" if use_cuda else "gloo")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        self.device = f"cuda:{local}" if use_cuda else "cpu"
        if use_cuda:
            torch.cuda.set_device(local)

    @property
    def main(self) -> bool:
        """Rank 0: the one that writes."""
        return self.rank == 0

    def local(self, xb: Tensor, yb: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's block of a global batch."""
        b = xb.shape[0] // self.world
        return xb[self.rank * b:(self.rank + 1) * b], yb[self.rank * b:(self.rank + 1) * b]

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[torch.device(self.device).index] if self.device.startswith("cuda") else None)

    def global_stats(self, loss: Tensor, correct: Tensor) -> tuple[float, int]:
        """(mean loss over the global batch, correct predictions in it): one ``all_reduce``
        (every rank has the same number of rows)."""
        t = torch.stack([loss.detach().double(), correct.double()])
        dist.all_reduce(t)
        loss_sum, n_correct = t.tolist()
        return loss_sum / self.world, int(round(n_correct))

    def from_main(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (a small host broadcast), e.g. a decision all
        ranks must share."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Destroy the process group (the one this process created under ``torchrun``)."""
        global _DESTROYED
        if dist.is_initialized():
            dist.destroy_process_group()
            _DESTROYED = True


def leave_if_destroyed() -> None:
    """End this process now, skipping the interpreter's teardown, if its run destroyed the
    process group it created (a ``torchrun`` rank whose outputs are written): there the gloo
    backend's thread destructors occasionally abort a finished rank ("terminate called
    without an active exception", exit -6). A no-op otherwise."""
    if _DESTROYED:
        from ..distributed.process_exit import exit_without_teardown
        exit_without_teardown()


def check_distributed(cfg: dict[str, Any], world: Optional[int]) -> Optional[str]:
    """The reason ``cfg`` cannot run distributed over ``world`` ranks, or None."""
    if world is None:
        return None
    if cfg["optimizer"] not in ("tengrad", "sgd"):
        return f"--distributed supports --optimizer tengrad or sgd, not {cfg['optimizer']}"
    if cfg["compile"]:
        return "--distributed does not support --compile"
    if cfg["batch_size"] % world:
        return f"--batch-size {cfg['batch_size']} (the global batch) must be a multiple of the world size {world}"
    return None
