"""The optimizers of ``tools.peer_bench``: the project's (SGD, TENGraD, K-FAC at the paper's
Fashion-MNIST settings), torch's AdamW, and the peers from ``pytorch_optimizer`` (the
``peers`` extra) at that library's defaults; on language models (:func:`lm_method`) TENGraD
takes its curvature every 20 steps. Then the methods' families and the verdict (the fastest
TENGraD against the fastest rival)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from tengrad_fx.optim.registry import PAPER_DEFAULTS, PRESETS, make_optimizer
from tengrad_fx.optim.tengrad.metric import Metric
from tengrad_fx.utils.optional import require
from tools.chained_optim import Chained

__all__ = ["LM_CURVATURE_EVERY", "METHODS", "PEERS", "PEER_PACKAGE", "RIVALS", "Method", "family", "lm_method",
           "parse_variant", "peer_library", "peer_versions", "tengrad_method", "verdict", "verdict_lines"]

PEER_PACKAGE = "pytorch-optimizer"
PEERS = ("muon", "soap", "shampoo", "psgd")
RIVALS = ("adamw", "muon-torch") + PEERS  # what users pick instead of TENGraD (SGD and K-FAC are the paper's baselines)
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
    """An optimizer of the benchmark: ``make(model, lr)`` = ``build(model, lr, **options)`` over
    the (prepared if ``prepared``) model; ``lr`` is its default; ``settings`` says where every
    other setting comes from (``options``: keywords on top, TENGraD's only)."""

    name: str
    lr: float
    build: Callable[..., torch.optim.Optimizer]
    settings: str
    prepared: bool = False
    peer: bool = False
    tengrad: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def make(self, model: nn.Module, lr: float) -> torch.optim.Optimizer:
        """``build(model, lr, **options)``: the optimizer over ``model`` at ``lr``."""
        return self.build(model, lr, **self.options)


def _head(model: nn.Module) -> set[nn.Parameter]:
    """Parameters of the output layer (the last ``nn.Linear``) and of every ``nn.Embedding``
    (a language model's token and position tables, tied or not to its output layer)."""
    last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    tables = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    return set(last.parameters()) | set(tables)


def _muon(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Muon on the hidden ≥2-D weights (conv kernels flattened), its AdamW on biases, norms,
    embeddings and the output layer; the AdamW lr (3e-4) is scaled with ``lr`` / 0.02 on an lr grid."""
    head = _head(model)
    hidden = [p for p in model.parameters() if p.ndim >= 2 and p not in head]
    rest = [p for p in model.parameters() if p.ndim < 2 or p in head]
    groups: list[dict[str, Any]] = [dict(params=hidden, use_muon=True), dict(params=rest, use_muon=False)]
    return peer_library().Muon(groups, lr=lr, adamw_lr=3e-4 * lr / 2e-2)


def _muon_torch(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """``torch.optim.Muon`` (its defaults but ``adjust_lr_fn="match_rms_adamw"``: AdamW's update
    RMS, AdamW's lr) on the hidden ≥2-D weights, ``torch.optim.AdamW`` (its defaults) on the
    embeddings, the output layer and the 1-D parameters, both at ``lr``, stepping together."""
    if not hasattr(torch.optim, "Muon"):
        raise ImportError(f"muon-torch needs torch.optim.Muon (torch ≥ 2.9); this is torch {torch.__version__}: "
                          "upgrade torch, or race pytorch_optimizer's Muon ('muon')")
    head = _head(model)
    hidden = [p for p in model.parameters() if p.ndim >= 2 and p not in head]
    rest = [p for p in model.parameters() if p.ndim < 2 or p in head]
    return Chained(torch.optim.Muon(hidden, lr=lr, adjust_lr_fn="match_rms_adamw"), torch.optim.AdamW(rest, lr=lr))


def _peer(cls: str, **fixed: Any) -> Callable[[nn.Module, float], torch.optim.Optimizer]:
    return lambda model, lr: getattr(peer_library(), cls)(model.parameters(), lr=lr, **fixed)


def _project(name: str, **fixed: Any) -> Callable[..., torch.optim.Optimizer]:
    """``make_optimizer(name, model, "fashion-mnist", lr=lr, **fixed, **options)``; a TENGraD
    option ``head_lr`` puts the embeddings and the output layer (:func:`_head`) in a param
    group of that lr without the polar factor (Muon's recipe: Adam-like steps there)."""
    def build(model: nn.Module, lr: float, **options: Any) -> torch.optim.Optimizer:
        opts = {**fixed, **options}
        head_lr = opts.pop("head_lr", None)
        if head_lr is not None:
            head = _head(model)
            opts["params"] = [dict(params=[p for p in model.parameters() if p not in head]),
                              dict(params=[p for p in model.parameters() if p in head], lr=float(head_lr),
                                   orthogonalize=False)]
        return make_optimizer(name, model, _FM, lr=lr, **opts)
    return build


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sgd", 0.03, _project("sgd"),
           "paper's Fashion-MNIST SGD: momentum 0.9, weight decay 1e-3"),
    Method("adamw", 1e-3, lambda mdl, lr: torch.optim.AdamW(mdl.parameters(), lr=lr),
           "torch.optim.AdamW defaults: betas (0.9, 0.999), eps 1e-8, weight decay 0.01"),
    Method("tengrad", 0.003, _project("tengrad"),
           "paper's Fashion-MNIST TENGraD: MC Fisher, curvature every 100 steps, KL clip 0.01, "
           "damping 0.1, weight decay 1e-3, momentum 0.9", prepared=True, tengrad=True),
    Method("tengrad-orth", 1e-3, _project("tengrad", preset="orthogonal"),
           "TENGraD's preset \"orthogonal\": the paper's settings with each weight's NGD update orthogonalized "
           "(RMS 0.2), RMSProp-grafted biases, lr 1e-3", prepared=True, tengrad=True),
    Method("tengrad-orth-ns", 1e-3, _project("tengrad", preset="orthogonal",
                                                   orthogonalize="newton-schulz"),
           "\"tengrad-orth\" with Muon's five Newton-Schulz steps for the polar factor (no eigensolver: no host "
           "read, CUDA graphs)", prepared=True, tengrad=True),
    Method("kfac", 0.003, _project("kfac"),
           "paper's Fashion-MNIST K-FAC: MC Fisher, statistics every 20 steps, inversion every 100, "
           "KL clip 0.01, damping 0.1, weight decay 1e-3, momentum 0.9", prepared=True),
    Method("muon", 2e-2, _muon,
           "pytorch_optimizer.Muon defaults (momentum 0.95 Nesterov, 5 Newton-Schulz steps, no weight decay) "
           "on hidden ≥2-D weights; its AdamW (lr 3e-4, betas (0.9, 0.95)) on biases and the output layer",
           peer=True),
    Method("muon-torch", 1e-3, _muon_torch,
           "torch.optim.Muon defaults (momentum 0.95 Nesterov, 5 Newton-Schulz steps, weight decay 0.1) with "
           "adjust_lr_fn=\"match_rms_adamw\" on hidden ≥2-D weights; torch.optim.AdamW defaults (betas (0.9, 0.999), "
           "weight decay 0.01) on embeddings, the output layer and 1-D parameters; one lr for both"),
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


def _metric_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with ``metric.FIELD=v`` keys folded into ``metric=Metric(kind, FIELD=v)``
    (``kind`` from ``metric=``, a string or a Metric)."""
    fields = {k.partition(".")[2]: v for k, v in opts.items() if k.startswith("metric.")}
    if not fields:
        return opts
    base = opts.get("metric")
    if base is None:
        raise ValueError(f"TENGraD variant: {', '.join('metric.' + k for k in fields)} needs metric=KIND")
    metric = replace(base, **fields) if isinstance(base, Metric) else Metric(base, **fields)
    return {**{k: v for k, v in opts.items() if not k.startswith("metric.")}, "metric": metric}


def tengrad_method(name: str, opts: dict[str, Any]) -> Method:
    """A prepared-model method building TENGraD at the paper's settings plus ``opts``
    (``metric.FIELD=v``: that field of :class:`~tengrad_fx.optim.tengrad.metric.Metric`)."""
    if "preset" in opts:  # the preset's options, then the others on top
        opts = {**PRESETS["tengrad"][opts["preset"]], **{k: v for k, v in opts.items() if k != "preset"}}
    opts = _metric_fields(opts)
    lr = float(opts.get("lr", PAPER_DEFAULTS["tengrad"][_FM]["3c1f"]["lr"]))
    kw = {k: v for k, v in opts.items() if k != "lr"}
    return Method(name, lr, _project("tengrad"), f"paper settings + {opts}", prepared=True, tengrad=True, options=kw)


LM_CURVATURE_EVERY = 20
"""TENGraD's curvature period on the language models (``curvature_every``; 100 on images)."""


def lm_method(method: Method) -> Method:
    """``method`` on a language model: a TENGraD one takes its curvature every
    ``LM_CURVATURE_EVERY`` steps unless its own options say otherwise; the others as they are."""
    if not method.tengrad or "curvature_every" in method.options:
        return method
    return replace(method, options={"curvature_every": LM_CURVATURE_EVERY, **method.options},
                   settings=f"{method.settings}; curvature every {LM_CURVATURE_EVERY} steps")


def family(method: Method) -> str:
    """``"tengrad"`` (any TENGraD), ``"rival"`` (what users pick instead: ``RIVALS``) or ``"baseline"``."""
    return "tengrad" if method.tengrad else "rival" if method.name in RIVALS else "baseline"


def verdict(summary: dict[str, dict[str, Any]], targets: list[str], key: str = "est_seconds",
            final: str = "final_acc") -> dict[str, Any]:
    """The fastest TENGraD against the fastest rival (by ``targets[t][key]``, estimated seconds)
    to each target, and the best ``final`` of each (``"final_acc"``: the highest accuracy,
    ``"final_loss"``: the lowest loss); ``ratio`` = TENGraD's time over the rival's (None
    where either reached no target, or either family did not run)."""
    groups = {f: {m: s for m, s in summary.items() if s["family"] == f} for f in ("tengrad", "rival")}
    out: dict[str, Any] = {"targets": {}, final: {}}
    for t in targets:
        best: dict[str, Any] = {}
        for f, group in groups.items():
            hits = [(s["targets"][t][key], m) for m, s in group.items() if s["targets"][t]]
            fastest = min(hits, default=None)
            best[f] = None if fastest is None else {"method": fastest[1], key: fastest[0]}
        tg, rv = best["tengrad"], best["rival"]
        ratio_ = tg[key] / rv[key] if tg and rv and rv[key] > 0 else None
        out["targets"][t] = {**best, "ratio": ratio_}
    pick = min if final == "final_loss" else max
    for f, group in groups.items():
        top = pick(group, key=lambda m: group[m][final], default=None)
        out[final][f] = None if top is None else {"method": top, final: group[top][final]}
    return out


def verdict_lines(v: dict[str, Any] | None, key: str = "est_seconds", unit: str = "s",
                  what: str = "estimated seconds") -> list[str]:
    """The verdict (times under ``key``, in ``unit``) as lines (none when TENGraD or no rival ran)."""
    final = "final_loss" if v and "final_loss" in v else "final_acc"
    if not v or not all(v[final].values()):
        return []
    lines = ["fastest TENGraD against the fastest of " + ", ".join(RIVALS) + f" (those run), {what}:"]
    for t, hit in v["targets"].items():
        tg, rv = hit["tengrad"], hit["rival"]
        both = f"{tg['method']} {tg[key]:.3g} {unit}, {rv['method']} {rv[key]:.3g} {unit}" if tg and rv else \
            f"{tg['method'] if tg else 'no TENGraD'} against {rv['method'] if rv else 'no rival'}"
        ratio_ = f": {hit['ratio']:.2f}x" if hit["ratio"] is not None else ""
        lines.append(f"  to {t}: {both}{ratio_}")
    tg, rv = v[final]["tengrad"], v[final]["rival"]
    label = "final validation loss" if final == "final_loss" else "final accuracy"
    lines.append(f"  {label}: {tg['method']} {tg[final]:.4f}, {rv['method']} {rv[final]:.4f}")
    return lines
