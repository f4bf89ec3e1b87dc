"""The block-inverse structure figure: exact NGD vs TENGraD vs K-FAC on one layer.

    python -m tools.structure --model 3c1f|small|<zoo name> [--layer NAME] [--slice 64]
        [--rows R] [--damping 0.1] [--m 64] [--seed 0] --out PATH.png

Builds the model (``zoo.get_model``, or a small local CNN for ``small``) in float64,
prepares it with :func:`tengrad_fx.prepare`, runs one batch of ``m`` images (real
Fashion-MNIST when ``/usr/share/datasets/fashion-mnist`` exists, random otherwise) forward
and backward with the default capture (records keep ``I`` and ``G``), and for one layer
(default: the last Linear) compares three damped inverses of its Fisher block
``F + αI``, ``F = JᵀJ/m`` (``J``: ``m × n`` per-sample gradients, weight then bias):

* **exact NGD** — ``(F + αI)⁻¹`` from ``layer.jacobian()`` by a dense float64 Cholesky of
  the ``n × n`` matrix (``n ≤ --dense-max``), else from the eigendecomposition of
  ``J Jᵀ`` (``F = V diag(σ²/m) Vᵀ``, ``V = JᵀUΣ⁻¹``) — both independent of Woodbury;
* **TENGraD** — the library's own path: ``K = layer.gram()`` (never forms ``J``), the
  damped Cholesky of ``K + mαI`` and ``(1/α)(e − Jᵀ(K + mαI)⁻¹J e)`` for each unit
  vector ``e`` of the slice, ``J e`` / ``Jᵀc`` through ``layer.jvp`` / ``layer.vjp``
  (:func:`tengrad_fx.solve.woodbury.woodbury_apply`). Exact, so its distance is ≈ 0;
* **K-FAC** — ``(A + √α I)⁻¹ ⊗ (G + √α I)⁻¹`` (damping split evenly, π = 1) with
  ``A = (1/m) Σ_i Σ_s ã ãᵀ`` (``ã`` = input, plus a 1 for the bias; unfolded patches for
  a conv) and ``G = (1/(mS)) Σ_i Σ_s g gᵀ`` (``g`` = per-sample output gradient, i.e.
  ``m·G`` for a mean loss; ``S`` positions, 1 for a plain Linear), from the captured
  records; entry ``[(o,k),(o′,k′)] = G⁻¹[o,o′]·A⁻¹[k,k′]``.

All three are the *whole layer's* damped inverse, restricted to the same slice of
coordinates (an ``s × s`` sub-block of the ``n × n`` matrix). The slice: by default the
first ``--slice`` coordinates of ``vec(W)`` (row-major, i.e. output row 0's first
inputs, continuing into row 1, ...); with ``--rows R`` the sub-block "first ``R`` output
rows × first ``⌈slice/R⌉`` inputs" (row-major), which shows K-FAC's Kronecker pattern.

Writes a 1×3 heatmap (shared diverging colour scale, clipped at the largest off-diagonal
``|exact|`` entry, so the off-diagonal structure is visible; the ``≈1/α`` diagonal saturates) as
PNG and SVG, and prints the relative Frobenius distance ``‖X − exact‖_F / ‖exact‖_F``.
"""
from __future__ import annotations

import argparse
import gzip
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx.curvature.layer import KERNELS, CoveredLayer
from tengrad_fx.solve.woodbury import damped_cholesky, woodbury_apply
from tengrad_fx.zoo import get_model

__all__ = ["StructureResult", "small_cnn", "load_batch", "slice_indices", "exact_inverse",
           "tengrad_inverse", "kfac_factors", "kfac_inverse", "block_structure", "plot_structure", "main"]

FMNIST_DIR = "/usr/share/datasets/fashion-mnist"


def small_cnn(num_classes: int = 10) -> nn.Module:
    """A tiny 28×28 CNN (one conv, pool, two Linear) for quick runs and tests."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4), nn.Flatten(),
        nn.Linear(4 * 7 * 7, 32), nn.ReLU(), nn.Linear(32, num_classes),
    )


def load_batch(m: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``m`` Fashion-MNIST training images (normalised) and labels, or random ones."""
    img = os.path.join(FMNIST_DIR, "train-images-idx3-ubyte.gz")
    lab = os.path.join(FMNIST_DIR, "train-labels-idx1-ubyte.gz")
    if os.path.exists(img) and os.path.exists(lab):
        with gzip.open(img) as f:
            imgs = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
        with gzip.open(lab) as f:
            labels = np.frombuffer(f.read(), np.uint8, offset=8)
        idx = np.random.default_rng(seed).choice(len(labels), size=m, replace=False)
        x = (torch.from_numpy(imgs[idx].copy()).to(dtype) / 255 - 0.2860) / 0.3530
        return x, torch.from_numpy(labels[idx].astype(np.int64)), "Fashion-MNIST"
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, 1, 28, 28, generator=g).to(dtype), torch.randint(0, 10, (m,), generator=g), "random")


def slice_indices(n_out: int, n_in: int, size: int, rows: Optional[int] = None) -> torch.Tensor:
    """Coordinates of the slice in ``vec(W)`` (row-major ``[n_out, n_in]``), see module doc."""
    if rows is None:
        if size > n_out * n_in:
            raise ValueError(f"--slice {size} exceeds the weight's {n_out * n_in} entries")
        return torch.arange(size)
    cols = math.ceil(size / rows)
    if rows > n_out or cols > n_in:
        raise ValueError(f"--rows {rows} × {cols} inputs does not fit the weight [{n_out}, {n_in}]")
    o = torch.arange(rows).repeat_interleave(cols)
    k = torch.arange(cols).repeat(rows)
    return o * n_in + k


def exact_inverse(J: torch.Tensor, damping: float, idx: torch.Tensor, dense_max: int = 8192) -> torch.Tensor:
    """``(JᵀJ/m + αI)⁻¹[idx][:, idx]`` in float64, without the Woodbury identity."""
    J = J.to(torch.float64)
    m, n = J.shape
    s = idx.numel()
    if n <= dense_max:
        M = J.T @ J / m
        M.diagonal().add_(damping)
        L = torch.linalg.cholesky(M)
        E = torch.zeros(n, s, dtype=torch.float64)
        E[idx, torch.arange(s)] = 1.0
        return torch.cholesky_solve(E, L)[idx]
    lam, U = torch.linalg.eigh(J @ J.T)  # J Jᵀ = U diag(σ²) Uᵀ
    keep = lam > lam.max() * 1e-13
    lam, U = lam[keep], U[:, keep]
    Vs = J[:, idx].T @ U / lam.sqrt()  # rows idx of V = Jᵀ U Σ⁻¹
    d = 1.0 / (lam / m + damping) - 1.0 / damping
    return (Vs * d) @ Vs.T + torch.eye(s, dtype=torch.float64) / damping


def _flat_params(layer: CoveredLayer) -> tuple[int, int]:
    nw = layer.weight.numel()
    return nw, nw + (layer.bias.numel() if layer.bias is not None else 0)


def tengrad_inverse(layer: CoveredLayer, damping: float, idx: torch.Tensor) -> torch.Tensor:
    """TENGraD's ``(F + αI)⁻¹[idx][:, idx]``: Gram + damped Cholesky + Woodbury, ``J``
    only through ``jvp``/``vjp`` of the captured ``I, G``."""
    m = layer.m
    nw, n = _flat_params(layer)
    K = layer.gram()
    chol = damped_cholesky(K, m * damping, dtype=torch.float64)
    w = layer.weight

    def jvp(v: torch.Tensor) -> torch.Tensor:
        vw = v[:nw].view_as(w).to(w.dtype)
        vb = v[nw:].view_as(layer.bias).to(w.dtype) if layer.bias is not None else None
        return layer.jvp(vw, vb)

    def vjp(c: torch.Tensor) -> torch.Tensor:
        gw, gb = layer.vjp(c.to(w.dtype))
        return gw.flatten() if gb is None else torch.cat([gw.flatten(), gb.flatten()])

    cols = []
    for j in idx.tolist():
        e = torch.zeros(n, dtype=w.dtype)
        e[j] = 1.0
        cols.append(woodbury_apply(chol, e, damping, jvp, vjp)[idx].to(torch.float64))
    return torch.stack(cols, 1)


def kfac_factors(layer: CoveredLayer, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K-FAC's ``(A [f(+1), f(+1)], G [o, o])`` from the captured ``I, G`` (float64).

    ``scale`` turns a captured output gradient into a per-sample one (``m`` for a mean loss).
    """
    if layer.spec.kind != "linear" and getattr(layer.spec, "groups", 1) != 1:
        raise ValueError(f"layer '{layer.name}': K-FAC factors of grouped convolutions are not supported here")
    if layer.spec.transposed:
        raise ValueError(f"layer '{layer.name}': no K-FAC factors for transposed convolutions")
    a_all, g_all = [], []
    for r in layer.records():
        if r.I is None or r.G is None:
            raise RuntimeError(f"layer '{layer.name}': records hold materialized per-sample gradients, "
                               "not I and G; pick a layer captured with the factor layout")
        A, B = KERNELS[layer.kind].layout(layer.spec, r.I, r.G)  # [m, g, S, f], [m, g, S, o]
        a_all.append(A[:, 0].to(torch.float64))
        g_all.append(B[:, 0].to(torch.float64) * scale)
    a = torch.cat(a_all, 1)  # [m, S, f]
    g = torch.cat(g_all, 1)  # [m, S, o]
    m, S, _ = a.shape
    if layer.bias is not None:
        a = torch.cat([a, torch.ones(m, S, 1, dtype=a.dtype)], 2)
    a2, g2 = a.reshape(m * S, -1), g.reshape(m * S, -1)
    return a2.T @ a2 / m, g2.T @ g2 / (m * S)


def kfac_inverse(A: torch.Tensor, G: torch.Tensor, damping: float, idx: torch.Tensor,
                 n_out: int, n_in: int) -> torch.Tensor:
    """``[(A + √αI)⁻¹ ⊗ (G + √αI)⁻¹]`` restricted to ``idx`` (coordinates of ``vec(W), b``)."""
    nw = n_out * n_in
    is_w = idx < nw
    o = torch.where(is_w, idx // n_in, idx - nw)
    k = torch.where(is_w, idx % n_in, torch.full_like(idx, n_in))  # bias ↔ the ones column
    pi = math.sqrt(damping)

    def inv_block(M: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        u = torch.unique(sel)
        Md = M.clone()
        Md.diagonal().add_(pi)
        L = torch.linalg.cholesky(Md)
        E = torch.zeros(M.shape[0], u.numel(), dtype=M.dtype)
        E[u, torch.arange(u.numel())] = 1.0
        sub = torch.cholesky_solve(E, L)[u]  # (M + πI)⁻¹[u][:, u]
        pos = torch.searchsorted(u, sel)
        return sub[pos][:, pos]

    return inv_block(G, o) * inv_block(A, k)


@dataclass
class StructureResult:
    layer: str
    n: int
    m: int
    damping: float
    idx: torch.Tensor
    exact: torch.Tensor
    tengrad: torch.Tensor
    kfac: torch.Tensor
    data: str

    def distances(self) -> dict[str, float]:
        """Relative Frobenius distance of TENGraD's and K-FAC's slice to the exact one."""
        nrm = torch.linalg.norm(self.exact)
        return {"tengrad": float(torch.linalg.norm(self.tengrad - self.exact) / nrm),
                "kfac": float(torch.linalg.norm(self.kfac - self.exact) / nrm)}


def _build(model_name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if model_name == "small":
        return small_cnn()
    return get_model(model_name)


def block_structure(model: str | nn.Module = "small", layer: Optional[str] = None, slice_size: int = 64,
                    rows: Optional[int] = None, damping: float = 0.1, m: int = 64, seed: int = 0,
                    dense_max: int = 8192) -> StructureResult:
    """Compute the three slices (see module docstring) for one layer of ``model``."""
    net = _build(model, seed) if isinstance(model, str) else model
    net = net.to(torch.float64).train()
    x, y, src = load_batch(m, seed)
    net = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    layers = tengrad_fx.covered_layers(net)
    if layer is None:
        lins = [lay for lay in layers if lay.kind == "linear"]
        if not lins:
            raise ValueError("model has no covered Linear layer; pass --layer")
        target = lins[-1]
    else:
        found = [lay for lay in layers if lay.name == layer]
        if not found:
            raise ValueError(f"no covered layer {layer!r}; covered: {', '.join(lay.name for lay in layers)}")
        target = found[0]
    F.cross_entropy(net(x), y).backward()
    w = target.weight
    n_out, n_in = w.shape[0], w[0].numel()
    nw, n = _flat_params(target)
    idx = slice_indices(n_out, n_in, slice_size, rows)
    scale = float(target.m) if tengrad_fx.get_info(net).loss_reduction == "mean" else 1.0
    with torch.no_grad():
        exact = exact_inverse(target.jacobian().detach(), damping, idx, dense_max)
        teng = tengrad_inverse(target, damping, idx)
        A, G = kfac_factors(target, scale)
        kf = kfac_inverse(A, G, damping, idx, n_out, n_in)
    return StructureResult(target.name, n, target.m, damping, idx, exact, teng, kf, src)


def plot_structure(res: StructureResult, out_path: str, title: Optional[str] = None) -> list[str]:
    """1×3 heatmaps (exact, TENGraD, K-FAC) as PNG + SVG; returns the paths."""
    from tengrad_fx.cli.plot import save_figure  # matplotlib (Agg), only where a figure is drawn

    import matplotlib.pyplot as plt

    d = res.distances()
    mats = [("exact NGD  (F+αI)⁻¹", res.exact, None), ("TENGraD (Woodbury)", res.tengrad, d["tengrad"]),
            ("K-FAC  (A+√αI)⁻¹⊗(G+√αI)⁻¹", res.kfac, d["kfac"])]
    off = res.exact - torch.diag(torch.diagonal(res.exact))
    vmax = float(off.abs().max()) or float(res.exact.abs().max()) or 1.0
    fig, axes = plt.subplots(1, 3, figsize=(15, 5.2), constrained_layout=True)
    im = None
    for ax, (name, M, dist) in zip(axes, mats):
        im = ax.imshow(M.numpy(), cmap="RdBu_r", vmin=-vmax, vmax=vmax, interpolation="nearest")
        ax.set_title(name if dist is None else f"{name}\nrel. Frobenius distance {dist:.2e}", fontsize=10)
        ax.set_xlabel("parameter index in slice")
    axes[0].set_ylabel("parameter index in slice")
    fig.colorbar(im, ax=axes, shrink=0.8, label=f"value (clipped at ±{vmax:.3g})")
    fig.suptitle(title or (f"layer {res.layer} (n={res.n}), {res.idx.numel()}-coordinate slice, "
                           f"m={res.m} {res.data} samples, α={res.damping}"))
    return save_figure(fig, out_path)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(prog="python -m tools.structure", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="3c1f", help="'small' (a tiny local CNN) or a zoo model name (default 3c1f)")
    ap.add_argument("--layer", default=None, help="covered layer name (default: the last Linear)")
    ap.add_argument("--slice", type=int, default=64, dest="slice_size", help="number of coordinates (default 64)")
    ap.add_argument("--rows", type=int, default=None,
                    help="take the first ROWS output rows × first ceil(slice/ROWS) inputs "
                         "instead of a prefix of vec(W)")
    ap.add_argument("--damping", type=float, default=0.1)
    ap.add_argument("--m", type=int, default=64, help="batch size (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dense-max", type=int, default=8192,
                    help="largest layer size n for the dense n×n exact inverse (else eigendecomposition of J Jᵀ)")
    ap.add_argument("--out", required=True, help="output .png (an .svg with the same stem is written too)")
    a = ap.parse_args(argv)
    res = block_structure(a.model, a.layer, a.slice_size, a.rows, a.damping, a.m, a.seed, a.dense_max)
    d = res.distances()
    paths = plot_structure(res, a.out)
    print(f"layer {res.layer}: n={res.n}, slice={res.idx.numel()}, m={res.m} ({res.data}), α={res.damping}")
    print("relative Frobenius distance to exact (F+αI)⁻¹ on the slice: "
          f"TENGraD {d['tengrad']:.3e}   K-FAC {d['kfac']:.3e}")
    for p in paths:
        print(p)
    return d


if __name__ == "__main__":
    main()
