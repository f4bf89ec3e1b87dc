"""Training runs of the FSDP2 tests: small float64 models sharded by ``fully_shard`` on
``W`` gloo ranks (:func:`train_fsdp`, run through :func:`testing.distributed.run_ranks`)
and the same model in one process on the concatenated batch (:func:`train_reference`).

A run is a ``cfg`` dict: ``model`` ("block": embedding tied to the output head, one
pre-norm transformer block with attention and an MLP, a final LayerNorm; "cnn": two
convolutions with BatchNorm (in eval mode, :func:`frozen_statistics`) and a Linear head;
"conv1d", "gpt2": Hugging Face's transposed Linear, :mod:`testing.fsdp_conv1d`; "mlp-extras", "cnn-grouped",
"cnn-split",
"tconv": per-sample-gradient layers, grouped and transposed convolutions, :mod:`testing.fsdp_extras`),
``m`` (local batch),
``steps``, ``T``, ``fisher``, ``kl_clip``, ``shard`` ("blocks": ``fully_shard`` on each
block and the root; "layers": on every Linear/conv too; "root": on the root only), ``order``
("prepare-first": ``prepare`` by torch.fx, then ``fully_shard``; with ``expect_error`` the
optimizer's ``ValueError`` is returned), ``mode`` and ``bandwidth`` (the optimizer's), ``opts``
(more optimizer keywords; ``reference``: the reference's own), ``plain`` (``TENGraD`` itself,
not ``DistributedTENGraD``), ``nan_rank``/``nan_step`` (that rank's gradient shard gets a NaN
before that step), ``mesh`` (``(R, S)``: HSDP, replicate × shard; default a 1-D mesh of all
ranks), ``start`` (first global batch),
``save``/``load`` (a torch.distributed.checkpoint directory written after the last step /
loaded before the first).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fsdp_conv1d as transposed
from . import fsdp_extras as extras
from . import fsdp_polar as polar

__all__ = ["make_model", "global_batch", "train_fsdp", "train_reference", "full_params", "run_example",
           "assert_follows_reference", "check_run",
           "train_accumulated", "accumulated_reference"]

VOCAB, SEQ, D = 11, 4, 6


class Block(nn.Module):
    """Pre-norm transformer block: 2-head attention and a Tanh MLP, residuals."""

    def __init__(self, d: int, hidden: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, s, d = x.shape
        h = self.ln1(x)
        q, k, v = (t.reshape(m, s, self.heads, -1).transpose(1, 2) for t in (self.q(h), self.k(h), self.v(h)))
        att = torch.softmax(q @ k.transpose(-1, -2) / (q.shape[-1] ** 0.5), -1) @ v
        x = x + self.o(att.transpose(1, 2).reshape(m, s, d))
        return x + self.fc2(torch.tanh(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Token embedding (tied to the head), one block, final LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.block = Block(D, 10)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.block(self.emb(idx))))


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn1 = nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5)
        self.c2, self.bn2 = nn.Conv2d(5, 4, 3, stride=2), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.bn1(self.c1(x)))
        x = torch.relu(self.bn2(self.c2(x)))
        return self.fc(x.flatten(1))


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    net: nn.Module = TinyLM() if kind == "block" else polar.MLP() if kind == "mlp" else extras.ExtrasMLP() \
        if kind == "mlp-extras" else extras.GroupedCNN() if kind == "cnn-grouped" else extras.TransposedCNN() \
        if kind == "tconv" else extras.SplitGroupsCNN() if kind == "cnn-split" else transposed.build(kind) \
        if kind in transposed.TRANSPOSED_KINDS else TinyCNN()
    net = net.double()
    for mod in net.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    return net


def frozen_statistics(net: nn.Module) -> nn.Module:
    """BatchNorm in eval mode (fixed statistics: the per-sample structure, the same on
    every rank; train-mode statistics would be each rank's batch's), after ``prepare``."""
    for mod in net.modules():
        if isinstance(mod, nn.BatchNorm2d):
            mod.eval()
    return net


def global_batch(kind: str, M: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    if kind in transposed.TRANSPOSED_KINDS:
        return transposed.batch(kind, M, g)
    if kind.startswith("mlp"):
        return polar.batch(M, g)
    if kind == "block":
        x = torch.randint(0, VOCAB, (M, SEQ), generator=g)
        return x, torch.randint(0, VOCAB, (M, SEQ), generator=g)
    return torch.randn(M, 3, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (M,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def opt_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's keywords of ``cfg`` (``opts``: any more, as given, over these)."""
    return {**dict(lr=0.1, damping=0.05, momentum=0.9, weight_decay=1e-3, curvature_every=cfg.get("T", 1),
                   fisher=cfg.get("fisher", "empirical"), kl_clip=cfg.get("kl_clip")), **cfg.get("opts", {})}


def state_bytes(opt: Any, params: list[torch.Tensor]) -> int:
    """Bytes this process holds in ``opt``'s per-parameter state (DTensors: their local shards)."""
    total = 0
    for p in params:
        for t in opt.state[p].values():
            if isinstance(t, torch.Tensor):
                local = t.to_local() if hasattr(t, "to_local") else t
                total += local.numel() * local.element_size()
    return total


def full_params(net: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name, whole (DTensors gathered: for the tests' comparisons)."""
    out = {}
    for name, p in net.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def _shard(net: nn.Module, cfg: dict[str, Any], world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    shape = cfg.get("mesh")
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=("replicate", "shard")) if shape else \
        init_device_mesh("cpu", (world,))
    kw: dict[str, Any] = {"mesh": mesh}
    if cfg.get("mp"):  # "low": compute in float32, gradients reduced in float64
        low = cfg["mp"] == "low"
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.float32 if low else torch.float64,
                                               reduce_dtype=torch.float64)
    blocks = [mod for mod in net.modules() if isinstance(mod, Block)] + transposed.blocks(net) \
        if cfg.get("shard") != "root" else []
    if cfg.get("shard") == "layers":  # innermost first: fully_shard shards the parameters not yet sharded
        kinds = (nn.Linear, nn.Conv2d, nn.ConvTranspose2d)
        blocks = [mod for mod in net.modules() if isinstance(mod, kinds) and mod is not getattr(net, "head", None)] \
            + blocks
    for mod in blocks:
        fully_shard(mod, **kw)
    fully_shard(net, **kw)
    return mesh


def _dp_rank(cfg: dict[str, Any], rank: int) -> int:
    return rank  # the data-parallel rank is the global rank (HSDP: replicate-major, like the mesh)


def train_fsdp(rank: int, world: int, cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``cfg`` in turn on this rank: parameters after each step (gathered), the MC
    targets, the bytes it sent on each step per layer, its momentum-buffer bytes and its optimizer's type."""
    import tengrad_fx
    from tengrad_fx.distributed import DistributedTENGraD
    out = []
    for cfg in cfgs:
        kind = cfg["model"]
        if kind == "polar-probe":
            out.append(polar.polar_probe(rank, world))
            continue
        net = make_model(kind)
        if cfg.get("order") == "prepare-first":  # fx-prepared, then fully_shard
            net = frozen_statistics(tengrad_fx.prepare(net))
            _shard(net, cfg, world)
        else:
            _shard(net, cfg, world)
            net = frozen_statistics(tengrad_fx.prepare(net, example_inputs=(global_batch(kind, 2, 0)[0],)))
        try:
            if cfg.get("plain"):  # single-process TENGraD on the sharded model
                opt = tengrad_fx.TENGraD(net, **opt_kwargs(cfg))
            else:
                opt = DistributedTENGraD(net, seed=cfg.get("seed", 0), mode=cfg.get("mode", "auto"),
                                         bandwidth=cfg.get("bandwidth", 50e9), params=polar.param_groups(net, cfg),
                                         **opt_kwargs(cfg))
        except ValueError as exc:
            if not cfg.get("expect_error"):
                raise
            out.append({"error": str(exc)})
            continue
        if cfg.get("load"):
            load_checkpoint(net, opt, cfg["load"])
        traj, targets, owners, comm = [full_params(net)], [], [], []
        r = _dp_rank(cfg, rank)
        with polar.counting_polar() as polar_calls:
            for k in range(cfg["steps"]):
                _one_step(net, opt, cfg, rank, world, r, k, targets)
                traj.append(full_params(net))
                comm.append(dict(opt.comm_bytes) if hasattr(opt, "comm_bytes") else {})
                owners.append(opt.polar_owners() if hasattr(opt, "polar_owners") else {})
        if cfg.get("save"):
            save_checkpoint(net, opt, cfg["save"])
        bufs = {n: opt.state[p]["momentum_buffer"] for n, p in net.named_parameters()
                if "momentum_buffer" in opt.state[p]}
        out.append({"traj": traj, "targets": targets, "type": type(opt).__name__, "counters": opt.counters,
                    "plan": opt.layer_plan(),
                    "state_bytes": state_bytes(opt, list(net.parameters())),
                    "bufs": {n: b.full_tensor() for n, b in bufs.items()},
                    "polar_calls": polar_calls, "polar_owners": owners, "comm": comm})
    return out


def _one_step(net: nn.Module, opt: Any, cfg: dict[str, Any], rank: int, world: int, r: int, k: int,
              targets: list[Optional[torch.Tensor]]) -> None:
    """Step ``k`` of :func:`train_fsdp` on data-parallel rank ``r``'s part of the global batch."""
    m = cfg["m"]
    x, y = global_batch(cfg["model"], world * m, cfg.get("start", 0) + k)
    x, y = x[r * m:(r + 1) * m], y[r * m:(r + 1) * m]
    outp = net(x)
    loss = _loss(outp, y)
    opt.zero_grad()
    opt.mc_capture(outp)
    targets.append(opt.last_mc_targets if cfg.get("fisher") == "mc" else None)
    opt.last_mc_targets = None
    loss.backward()
    if cfg.get("nan_rank") == rank and cfg.get("nan_step") == k:  # a NaN in this rank's gradient shard
        next(p for p in net.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = float("nan")
    opt.step()


def save_checkpoint(net: nn.Module, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_sd, opt_sd = get_state_dict(net, opt)
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=path)


def load_checkpoint(net: nn.Module, opt: Any, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model_sd, opt_sd = get_state_dict(net, opt)
    sd = {"model": model_sd, "optim": opt_sd}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def train_reference(cfg: dict[str, Any], world: int, targets: Optional[list[Optional[torch.Tensor]]] = None,
                    stats: Optional[dict[str, Any]] = None) -> list[dict[str, torch.Tensor]]:
    """Single-process TENGraD on the concatenated batches (``world·m`` samples), MC with
    ``targets[k]``, ``cfg["reference"]``'s options over ``cfg``'s; parameters after each step
    (``stats["state_bytes"]``: its per-parameter state's bytes at the end)."""
    import tengrad_fx
    kind, M = cfg["model"], world * cfg["m"]
    example = (global_batch(kind, 2, 0)[0],) if kind in transposed.TRANSPOSED_KINDS else None  # surgery (HF)
    net = frozen_statistics(tengrad_fx.prepare(make_model(kind), example_inputs=example))
    opt = tengrad_fx.TENGraD(net, params=polar.param_groups(net, cfg), **{**opt_kwargs(cfg),
                                                                          **cfg.get("reference", {})})
    opt.seed_mc(cfg.get("seed", 0))  # MC labels, position rows: DistributedTENGraD seeds its generator with seed
    traj = [full_params(net)]
    for k in range(cfg["steps"]):
        x, y = global_batch(kind, M, cfg.get("start", 0) + k)
        out = net(x)
        loss = _loss(out, y)
        opt.zero_grad()
        opt.mc_capture(out, targets[k] if targets is not None else None)
        loss.backward()
        opt.step()
        traj.append(full_params(net))
    if stats is not None:
        stats["state_bytes"] = state_bytes(opt, list(net.parameters()))
    return traj


def assert_follows_reference(got: list[dict[str, Any]], ref: list[dict[str, torch.Tensor]], steps: int,
                             tol: float) -> None:
    """Every parameter's change at every step of rank 0's run (``got[0]["traj"]``) equals
    the reference's to ``tol`` (relative; each reference change nonzero), and every rank
    holds rank 0's parameters bit for bit."""
    traj = got[0]["traj"]
    for k in range(1, steps + 1):
        for n in ref[k]:
            d, dr = traj[k][n] - traj[k - 1][n], ref[k][n] - ref[k - 1][n]
            assert dr.norm() > 0, f"{n} did not move"
            err = ((d - dr).norm() / dr.norm()).item()
            assert err <= tol, f"step {k - 1}, {n}: relative error {err:.2e} vs the global-batch update"
        assert all(torch.equal(r["traj"][k][n], traj[k][n]) for r in got[1:] for n in traj[k]), "the ranks differ"


def check_run(cfg: dict[str, Any], ranks: list[dict[str, Any]], tol: float) -> list[dict[str, torch.Tensor]]:
    """``cfg``'s run on ``ranks`` (:func:`train_fsdp`'s results) took every step with
    ``DistributedTENGraD`` and follows :func:`train_reference` on the concatenated batch (MC:
    the reference draws its own labels, from the generator seeded as the ranks' one) to
    ``tol`` (:func:`assert_follows_reference`; parameters the reference never moves, e.g.
    frozen ones, unchanged); the reference's trajectory."""
    assert ranks[0]["type"] == "FSDPTENGraD"
    assert ranks[0]["counters"] == {"step": cfg["steps"], "skipped": 0, "uncaptured": 0}
    ref = train_reference(cfg, len(ranks))
    assert ranks[0]["traj"][0].keys() == ref[0].keys()
    frozen = {n for n in ref[0] if torch.equal(ref[-1][n], ref[0][n])}  # mlp-extras: fc2.weight
    assert all(torch.equal(ranks[0]["traj"][-1][n], ref[0][n]) for n in frozen)
    assert_follows_reference(ranks, [{n: t for n, t in r.items() if n not in frozen} for r in ref], cfg["steps"], tol)
    return ref


def run_example(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """``examples/fsdp2_train.py``'s ``main(argv)`` on this rank: its losses."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_train.py"
    spec = importlib.util.spec_from_file_location("_example_fsdp2_train", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {"losses": module.main(argv)}


def _accumulated_step(net: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    """One step over ``k`` equal micro-batches of ``(x, y)``, each loss times ``1/k``."""
    opt.zero_grad()
    for xj, yj in zip(x.chunk(k), y.chunk(k)):
        (_loss(net(xj), yj) / k).backward()
    opt.step()


def train_accumulated(rank: int, world: int, cfgs: list[dict[str, Any]]) -> list[list[dict[str, torch.Tensor]]]:
    """Per ``cfg``: ``cfg["accum"]`` micro-batches per step on every rank (FSDP2, empirical
    Fisher); parameters after each step."""
    import tengrad_fx
    from tengrad_fx.distributed import DistributedTENGraD
    out = []
    for cfg in cfgs:
        kind, m = cfg["model"], cfg["m"]
        net = make_model(kind)
        _shard(net, cfg, world)
        net = frozen_statistics(tengrad_fx.prepare(net, example_inputs=(global_batch(kind, 2, 0)[0],)))
        opt = DistributedTENGraD(net, mode=cfg.get("mode", "auto"), **opt_kwargs(cfg))
        traj = [full_params(net)]
        for k in range(cfg["steps"]):
            x, y = global_batch(kind, world * m, k)
            _accumulated_step(net, opt, x[rank * m:(rank + 1) * m], y[rank * m:(rank + 1) * m], cfg["accum"])
            traj.append(full_params(net))
        out.append(traj)
    return out


def accumulated_reference(cfg: dict[str, Any], world: int) -> list[dict[str, torch.Tensor]]:
    """Single-process TENGraD over the same micro-batches (all ranks' ``j``-th ones are the
    reference's ``j``-th micro-batch: the union of the records is the same set of samples)."""
    import tengrad_fx
    kind, m, acc = cfg["model"], cfg["m"], cfg["accum"]
    net = frozen_statistics(tengrad_fx.prepare(make_model(kind)))
    opt = tengrad_fx.TENGraD(net, **opt_kwargs(cfg))
    traj = [full_params(net)]
    for k in range(cfg["steps"]):
        x, y = global_batch(kind, world * m, k)
        parts = [(x[r * m:(r + 1) * m].chunk(acc), y[r * m:(r + 1) * m].chunk(acc)) for r in range(world)]
        xs = torch.cat([torch.cat([px[j] for px, _ in parts]) for j in range(acc)])
        ys = torch.cat([torch.cat([py[j] for _, py in parts]) for j in range(acc)])
        _accumulated_step(net, opt, xs, ys, acc)
        traj.append(full_params(net))
    return traj


def run_table(tmp: Path, world: int, table: dict[str, dict[str, Any]],
              ckpt: Optional[Path] = None) -> dict[str, list[dict[str, Any]]]:
    """Every config of ``table`` (name -> :func:`train_fsdp`'s config) on ``world`` spawned
    gloo ranks (one spawn): ``{name: [rank 0's result, rank 1's, ...]}``; the configs'
    ``save`` / ``load`` names taken as files under ``ckpt``."""
    from .distributed import run_ranks
    cfgs = [{**cfg, **{k: str(ckpt / cfg[k]) for k in ("save", "load") if k in cfg}} if ckpt is not None else cfg
            for cfg in table.values()]
    res = run_ranks(train_fsdp, world, tmp, cfgs, timeout=600)
    return {name: [r[i] for r in res] for i, name in enumerate(table)}
