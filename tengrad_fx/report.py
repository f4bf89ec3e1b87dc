"""``report(model)``: the coverage table of a prepared model."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from .capture.info import get_info
from .capture.norm import BN_NOTE, NORM_KINDS
from .curvature.layer import KERNELS, choose_strategy

__all__ = ["report", "Report"]


@dataclass
class Report:
    """Rows ``(parameter, status, detail)`` and each parameter's size (``numel``);
    ``str()`` renders a table, then the covered fraction by tensors and by parameter
    count, then every fallback with its reason."""

    rows: list[tuple[str, str, str]]
    header: str
    numel: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def n_covered(self) -> int:
        return sum(1 for _, s, _ in self.rows if s == "covered")

    @property
    def n_fallback(self) -> int:
        return sum(1 for _, s, _ in self.rows if s == "fallback")

    @property
    def n_frozen(self) -> int:
        return sum(1 for _, s, _ in self.rows if s == "frozen")

    @property
    def params_covered(self) -> int:
        """Number of scalar parameters in covered tensors."""
        return sum(self.numel.get(p, 0) for p, s, _ in self.rows if s == "covered")

    @property
    def params_total(self) -> int:
        """Number of scalar parameters in trainable (not frozen) tensors."""
        return sum(self.numel.get(p, 0) for p, s, _ in self.rows if s != "frozen")

    @property
    def fraction_tensors(self) -> float:
        """Covered fraction of the trainable parameter tensors (1.0 for a model without any)."""
        n = self.n_covered + self.n_fallback
        return self.n_covered / n if n else 1.0

    @property
    def fraction_params(self) -> float:
        """Covered fraction of the trainable parameters by count."""
        total = self.params_total
        return self.params_covered / total if total else 1.0

    @property
    def fallbacks(self) -> dict[str, str]:
        """``{parameter: reason}`` of every fallback parameter."""
        return {p: d for p, s, d in self.rows if s == "fallback"}

    def summary(self) -> str:
        """One line: covered tensors and parameters, with fractions (frozen ones excluded)."""
        tail = f", {self.n_frozen} frozen (requires_grad=False)" if self.n_frozen else ""
        return (f"{self.n_covered} covered, {self.n_fallback} fallback (SGD-momentum){tail} tensors: "
                f"covered {100 * self.fraction_tensors:.1f} % by tensors, "
                f"{100 * self.fraction_params:.2f} % by parameter count "
                f"({self.params_covered:,} / {self.params_total:,})")

    def __str__(self) -> str:
        w0 = max([len("parameter")] + [len(r[0]) for r in self.rows])
        lines = [self.header, *self.notes, f"{'parameter':<{w0}}  {'status':<8}  {'numel':>9}  detail",
                 "-" * (w0 + 52)]
        lines += [f"{p:<{w0}}  {s:<8}  {self.numel.get(p, 0):>9}  {d}" for p, s, d in self.rows]
        lines.append(self.summary())
        fb = self.fallbacks
        if fb:
            lines.append("fallbacks:")
            lines += [f"  - {p} ({self.numel.get(p, 0)}): {why}" for p, why in fb.items()]
        return "\n".join(lines)


def report(model: nn.Module, m: int = 128) -> Report:
    """Every parameter of a prepared model: covered (layer kind, shapes, Gram strategy at
    batch ``m`` from the probed input shapes), fallback (reason), or frozen
    (``requires_grad=False`` now: not preconditioned; a covered layer's parameter is
    covered again once unfrozen, without a new prepare). A covered layer's trainable bias
    under a frozen weight is covered as a bias-only layer (BitFit)."""
    info = get_info(model)
    by_layer = {spec.name: spec for spec in info.layers}
    rows = []
    numel: dict[str, int] = {}
    for pname, p in getattr(model, "_orig_mod", model).named_parameters():
        numel[pname] = p.numel()
        layer = info.covered.get(pname)
        if not p.requires_grad:
            rows.append((pname, "frozen", "requires_grad=False: not preconditioned" + (
                f"; layer '{layer or '(root)'}' covers it when unfrozen" if layer is not None else "")))
        elif layer is not None and not by_layer[layer].weight.requires_grad:
            rows.append((pname, "covered", f"bias-only {by_layer[layer].kind} '{layer or '(root)'}' "
                         f"{tuple(p.shape)} (weight frozen): per-sample gradient Σ_s G, no input kept"))
        elif layer is not None and by_layer[layer].kind == "param":
            rows.append((pname, "covered", f"added parameter {tuple(p.shape)} at {len(by_layer[layer].sites)} "
                         "use(s), per-sample gradient summed over broadcast dims"))
        elif layer is not None:
            spec = by_layer[layer]
            detail = f"{spec.kind} '{spec.name or '(root)'}' {tuple(p.shape)}"
            if spec.groups > 1 and spec.kind not in NORM_KINDS:
                detail += f" groups={spec.groups}"
            if len(spec.sites) > 1:
                detail += f" calls={len(spec.sites)}"
            if spec.input_shapes:
                kern = KERNELS[spec.kind]
                g = S = f = o = 0
                for shp in spec.input_shapes:
                    g, s, f, o = kern.dims(spec, shp)
                    S += s
                how = choose_strategy(m, g, S, f, o) if getattr(kern, "MATERIALIZE", True) else "index matching"
                detail += f" S={S} auto->{how}@m={m}"
            rows.append((pname, "covered", detail))
        else:
            rows.append((pname, "fallback", info.fallback.get(pname, "not covered")))
    via = {"fx": "torch.fx graph", "fx-dual": "torch.fx graphs (train/eval differ)",
           "surgery": f"module surgery (fx failed: {info.trace_error})"}[info.method]
    check = "verified at batch 2 and 3" if info.verified else "checked at run time"
    header = f"tengrad_fx.prepare: {len(info.layers)} layers via {via}; sample dim {check}"
    notes = [BN_NOTE] if any(spec.kind == "batchnorm" for spec in info.layers) else []
    return Report(rows=rows, header=header, numel=numel, notes=notes)
