"""TENGraD on a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), under torchrun.

Each transformer block and the root are ``fully_shard``-ed FIRST, then the model is
prepared with example inputs (``prepare`` swaps the covered modules' classes in place, so
FSDP's hooks still gather each block's parameters for its forward and backward). The
optimizer is ``DistributedTENGraD``: on FSDP2 models every rank preconditions its own rows
of each parameter with the global batch's Fisher blocks, and its momentum buffers are
DTensors sharded like the parameters. A checkpoint is written and read back through
``torch.distributed.checkpoint`` (it reshards: load it on another number of ranks).

The task is synthetic (no download): next-token prediction on sequences that count up
modulo the vocabulary from a random start.

    torchrun --nproc_per_node 2 examples/fsdp2_train.py --steps 100
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --smoke      # a few steps, CPU/gloo
    torchrun --nproc_per_node 4 examples/fsdp2_train.py --hsdp 2     # 2 replicas x 2 shards
"""
from __future__ import annotations

import argparse
import tempfile
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tengrad_fx
from tengrad_fx.distributed import DistributedTENGraD, exit_without_teardown


class Block(nn.Module):
    """Pre-norm transformer block (causal self-attention, GELU MLP)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).reshape(m, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(m, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int, depth: int, heads: int, length: int):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight  # tied input and output embeddings
        for emb in (self.emb, self.pos):
            nn.init.normal_(emb.weight, std=0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batch(step: int, n: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences counting up modulo ``vocab`` (inputs, next-token targets)."""
    g = torch.Generator().manual_seed(step)
    seq = (torch.randint(0, vocab, (n, 1), generator=g) + torch.arange(length + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def main(argv: Optional[Sequence[str]] = None) -> list[float]:
    """Train; the losses of this rank's steps. Joins the process group torchrun describes
    unless one is initialized already (and then leaves it to its owner)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=32, help="global batch (a multiple of the data-parallel ranks)")
    ap.add_argument("--hsdp", type=int, default=0, help="replicas of a 2-D (replicate x shard) mesh; 0: 1-D")
    ap.add_argument("--smoke", action="store_true", help="4 steps of a tiny model, and a checkpoint round trip")
    args = ap.parse_args(argv)
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    steps, vocab, length = (4, 16, 8) if args.smoke else (args.steps, 64, 32)
    kind = device.type if device is not None else "cpu"
    mesh = init_device_mesh(kind, (args.hsdp, world // args.hsdp), mesh_dim_names=("replicate", "shard")) \
        if args.hsdp else init_device_mesh(kind, (world,))
    torch.manual_seed(0)
    model = TinyLM(vocab, 32 if args.smoke else 128, 2, 4, length)
    if device is not None:
        model = model.to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    m = args.batch // world
    x0 = batch(0, 2, length, vocab)[0]
    net = tengrad_fx.prepare(model, example_inputs=(x0.to(device) if device is not None else x0,))
    opt = DistributedTENGraD(net, lr=0.1, damping=0.1, momentum=0.9, curvature_every=10, kl_clip=0.01)
    losses = []
    for step in range(steps):
        x, y = (t[rank * m:(rank + 1) * m] for t in batch(step, m * world, length, vocab))
        if device is not None:
            x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            path = [tmp]
            dist.broadcast_object_list(path)  # rank 0's directory on every rank (one machine)
            model_sd, optim_sd = get_state_dict(net, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path[0])
            model_sd, optim_sd = get_state_dict(net, opt)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=path[0])
            set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            dist.barrier()
        if rank == 0:
            print("checkpoint round trip done", flush=True)
    if owner:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()
    exit_without_teardown()  # outputs written, process group destroyed
