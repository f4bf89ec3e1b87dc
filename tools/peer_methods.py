"""The optimizers of ``tools.peer_bench``: the project's (SGD, TENGraD, K-FAC at the paper's
Fashion-MNIST settings), torch's AdamW, and the peers from ``pytorch_optimizer`` (the
``peers`` extra) at that library's defaults."""
from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from types import ModuleType
from typing import Any, Callable

import torch
import torch.nn as nn

from tengrad_fx.optim.registry import PAPER_DEFAULTS, PRESETS, make_optimizer
from tengrad_fx.utils.optional import require

__all__ = ["METHODS", "PEERS", "PEER_PACKAGE", "RIVALS", "Method", "parse_variant", "peer_library", "peer_versions",
           "tengrad_method"]

PEER_PACKAGE = "pytorch-optimizer"
PEERS = ("muon", "soap", "shampoo", "psgd")
RIVALS = ("adamw",) + PEERS  # what users pick instead of TENGraD (SGD and K-FAC are the paper's baselines)
_FM = "fashion-mnist"


def peer_library() -> ModuleType:
    """``pytorch_optimizer``, or an ``ImportError`` naming the ``peers`` extra."""
    return require("pytorch_optimizer", "peers", "tools.peer_bench's peers (" + ", ".join(PEERS) + ")")


def peer_versions() -> dict[str, str | None]:
    """Installed versions of torch and the peers' package (None where absent)."""
    out: dict[str, str | None] = {"torch": torch.__version__}
    try:
        out[PEER_PACKAGE] = metadata.version(PEER_PACKAGE)
    except metadata.PackageNotFoundError:
        out[PEER_PACKAGE] = None
    return out


@dataclass(frozen=True)
class Method:
    """An optimizer of the benchmark: ``build(model, lr)`` over the (prepared if ``prepared``)
    model; ``lr`` is its default; ``settings`` says where every other setting comes from."""

    name: str
    lr: float
    build: Callable[[nn.Module, float], torch.optim.Optimizer]
    settings: str
    prepared: bool = False
    peer: bool = False
    tengrad: bool = False


def _head(model: nn.Module) -> set[nn.Parameter]:
    """Parameters of the output layer (the last ``nn.Linear``)."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    return set(last.parameters())


def _muon(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Muon on the hidden ≥2-D weights (conv kernels flattened), its AdamW on biases and the
    output layer; the AdamW lr (3e-4) is scaled with ``lr`` / 0.02 on an lr grid."""
    head = _head(model)
    hidden = [p for p in model.parameters() if p.ndim >= 2 and p not in head]
    rest = [p for p in model.parameters() if p.ndim < 2 or p in head]
    groups: list[dict[str, Any]] = [dict(params=hidden, use_muon=True), dict(params=rest, use_muon=False)]
    return peer_library().Muon(groups, lr=lr, adamw_lr=3e-4 * lr / 2e-2)


def _peer(cls: str, **fixed: Any) -> Callable[[nn.Module, float], torch.optim.Optimizer]:
    return lambda model, lr: getattr(peer_library(), cls)(model.parameters(), lr=lr, **fixed)


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sgd", 0.03, lambda mdl, lr: make_optimizer("sgd", mdl, _FM, lr=lr),
           "paper's Fashion-MNIST SGD: momentum 0.9, weight decay 1e-3"),
    Method("adamw", 1e-3, lambda mdl, lr: torch.optim.AdamW(mdl.parameters(), lr=lr),
           "torch.optim.AdamW defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01"),
    Method("tengrad", 0.003, lambda mdl, lr: make_optimizer("tengrad", mdl, _FM, lr=lr),
           "paper's Fashion-MNIST TENGraD: MC Fisher, curvature every 100 steps, KL clip 0.01, "
           "damping 0.1, weight decay 1e-3, momentum 0.9", prepared=True, tengrad=True),
    Method("tengrad-orth", 1e-3, lambda mdl, lr: make_optimizer("tengrad", mdl, _FM, preset="orthogonal", lr=lr),
           "TENGraD's preset \"orthogonal\": the paper's settings with each weight's NGD update orthogonalized "
           "(RMS 0.2), RMSProp-grafted biases, lr 1e-3", prepared=True, tengrad=True),
    Method("tengrad-orth-ns", 1e-3, lambda mdl, lr: make_optimizer("tengrad", mdl, _FM, preset="orthogonal", lr=lr,
                                                                    orthogonalize="newton-schulz"),
           "\"tengrad-orth\" with Muon's five Newton-Schulz steps for the polar factor (no eigensolver: no host "
           "read, CUDA graphs)", prepared=True, tengrad=True),
    Method("kfac", 0.003, lambda mdl, lr: make_optimizer("kfac", mdl, _FM, lr=lr),
           "paper's Fashion-MNIST K-FAC: MC Fisher, statistics every 20 steps, inversion every 100, "
           "KL clip 0.01, damping 0.1, weight decay 1e-3, momentum 0.9", prepared=True),
    Method("muon", 2e-2, _muon,
           "pytorch_optimizer.Muon defaults (momentum 0.95 Nesterov, 5 Newton-Schulz steps, no weight decay) "
           "on hidden ≥2-D weights; its AdamW (lr 3e-4, betas (0.9, 0.95)) on biases and the output layer",
           peer=True),
    Method("soap", 3e-3, _peer("SOAP"),
           "pytorch_optimizer.SOAP defaults: betas (0.95, 0.95), weight decay 0.01, eigenbases every 10 steps, "
           "dimensions > 10000 not preconditioned", peer=True),
    Method("shampoo", 1e-3, _peer("ScalableShampoo", preconditioning_compute_steps=100),
           "pytorch_optimizer.ScalableShampoo defaults (blocks of 512, SGD grafting, Nesterov, betas (0.9, 0.999), "
           "preconditioning from step 25) except preconditioners every 100 steps (default 1000)", peer=True),
    Method("psgd", 1e-3, _peer("Kron"),
           "pytorch_optimizer.Kron (PSGD, Kronecker-factored) defaults: momentum 0.9, preconditioner updated every "
           "step for 500 steps (then annealed to 0.03), dimensions > 8192 diagonal", peer=True),
)}
"""The benchmark's optimizers by name (the module docstring of ``tools.peer_bench``)."""


def parse_value(text: str) -> Any:
    """``"3"`` → 3, ``"0.1"`` → 0.1, ``"None"`` → None, ``"True"`` → True, else the string."""
    special = {"None": None, "True": True, "False": False}
    if text in special:
        return special[text]
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"name:k=v,k=v"`` → (name, {k: v}); a bare ``"k=v,..."`` is named after itself."""
    name, _, body = spec.rpartition(":") if ":" in spec else (spec, "", spec)
    opts = {}
    for item in filter(None, body.split(",")):
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"TENGraD variant {spec!r}: {item!r} is not key=value")
        opts[key.strip()] = parse_value(val.strip())
    return name, opts


def tengrad_method(name: str, opts: dict[str, Any]) -> Method:
    """A prepared-model method building TENGraD at the paper's settings plus ``opts``."""
    if "preset" in opts:  # the preset's options, then the others on top
        opts = {**PRESETS["tengrad"][opts["preset"]], **{k: v for k, v in opts.items() if k != "preset"}}
    lr = float(opts.get("lr", PAPER_DEFAULTS["tengrad"][_FM]["3c1f"]["lr"]))
    kw = {k: v for k, v in opts.items() if k != "lr"}
    return Method(name, lr, lambda mdl, lr_: make_optimizer("tengrad", mdl, _FM, lr=lr_, **kw),
                  f"paper settings + {opts}", prepared=True, tengrad=True)
