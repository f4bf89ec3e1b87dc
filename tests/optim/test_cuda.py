"""GPU-only checks (skipped without CUDA): a warmed-up step never synchronizes, the CUDA
step equals the CPU one (float64) over 5 steps of each kind, ``cuda_graph=True`` (replayed
reuse steps, the default on CUDA) equals eager (float64 to 1e-9, float32 to 1e-6).

``torch.cuda.set_sync_debug_mode("error")`` makes every synchronizing CUDA call raise,
so this is the real-device counterpart of ``tests/optim/test_syncs.py``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KINDS = {"empirical-T1": dict(curvature_every=1), "mc-T1": dict(fisher="mc", curvature_every=1),
         "empirical-T3": dict(curvature_every=3), "mc-T100": dict(fisher="mc", curvature_every=100, kl_clip=0.01),
         "newton-schulz-T3": dict(curvature_every=3, orthogonalize="newton-schulz", graft="rmsprop"),
         "subsampled-T3": dict(curvature_every=3, curvature_samples=16)}
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-6, atol=1e-6)}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3), nn.Flatten(),
                         nn.Linear(8 * 9 * 9, 32), nn.ReLU(), nn.Linear(32, 10))


def _run(device: str, steps: int, debug_sync: bool = False, dtype: torch.dtype = torch.float32,
         schedule: bool = False, **kw) -> list[torch.Tensor]:
    net = _net().to(device, dtype)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 1, 28, 28, generator=g, dtype=dtype), torch.randint(0, 10, (32,), generator=g))
            for _ in range(steps)]
    pm = tengrad_fx.prepare(net, example_inputs=(data[0][0][:2].to(device),))
    opt = TENGraD(pm, lr=0.01, damping=0.1, momentum=0.9, weight_decay=1e-3, **kw)
    for t, (x, y) in enumerate(data):
        if schedule:  # an lr that changes at every step
            opt.param_groups[0]["lr"] = 0.01 * (1.0 - 0.05 * t)
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        out = pm(x)
        torch.manual_seed(10 + t)
        opt.mc_capture(out)
        F.cross_entropy(out, y).backward()
        if debug_sync and t >= 3:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert opt.counters["skipped"] == 0
    if kw.get("cuda_graph"):
        assert opt.graph_runner.graphs.replays >= 5 and not opt.graph_runner.graphs.failed
    return [p.detach().cpu() for p in pm.parameters()]


@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_step_never_synchronizes(kind: str) -> None:
    """The eager step (what a CUDA graph captures) never synchronizes."""
    _run("cuda", 7, debug_sync=True, cuda_graph=False, **KINDS[kind])


@pytest.mark.parametrize("kind", list(KINDS))
def test_cuda_step_equals_cpu_step(kind: str) -> None:
    kw = copy.deepcopy(KINDS[kind])
    if kw.get("fisher") == "mc":
        pytest.skip("MC labels come from different RNG streams on CPU and CUDA")
    # float64: no TF32 convolutions; on CUDA the default (reuse steps as CUDA graphs)
    cpu, gpu = _run("cpu", 5, dtype=torch.float64, **kw), _run("cuda", 5, dtype=torch.float64, **kw)
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b, a, **TOL[torch.float64])


GRAPHED = ["empirical-T3", "mc-T100", "newton-schulz-T3", "subsampled-T3"]


@pytest.fixture(autouse=True)
def _deterministic_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs compared to roundoff use the same convolution algorithms. With cuDNN free to
    pick nondeterministic ones, two float32 runs of "newton-schulz-T3" differed by 7 % after
    10 steps on an H200 (bit-identical with these settings). The likely amplifier: its
    RMSProp-grafted first conv bias feeds a BatchNorm, so its gradient is roundoff, and
    g / (sqrt(v) + eps) turns that into steps of the lr's size with the roundoff's sign."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", GRAPHED)
def test_cuda_graph_replay_equals_eager(kind: str, dtype: torch.dtype) -> None:
    """5+ reuse steps replayed from a captured CUDA graph equal the eager ones (float64 to
    1e-9, float32 to 1e-6). 10 steps: at T=3 the reuse steps are 1, 2, 4, 5, 7, 8; the first
    is the eager warm-up."""
    kw = dict(KINDS[kind])
    eager = _run("cuda", 10, cuda_graph=False, dtype=dtype, **kw)
    graphed = _run("cuda", 10, cuda_graph=True, dtype=dtype, **kw)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, **TOL[dtype])


def test_cuda_graph_replays_one_graph_under_an_lr_schedule() -> None:
    """The lr changes at every step: the reuse steps still replay (the lr is a static device
    scalar, not part of the graph's key) and equal the eager steps (float64, to 1e-9; an lr
    frozen at its captured value would be off by 5 % of a step per step)."""
    kw = dict(KINDS["empirical-T3"])
    eager = _run("cuda", 10, cuda_graph=False, schedule=True, dtype=torch.float64, **kw)
    graphed = _run("cuda", 10, cuda_graph=True, schedule=True, dtype=torch.float64, **kw)  # ≥ 5 replays
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, **TOL[torch.float64])


def test_cuda_graph_is_the_default_on_cuda() -> None:
    pm = tengrad_fx.prepare(_net().cuda(), example_inputs=(torch.randn(2, 1, 28, 28, device="cuda"),))
    assert TENGraD(pm, lr=0.01, damping=0.1).cuda_graph
    assert not TENGraD(pm, lr=0.01, damping=0.1, cuda_graph=False).cuda_graph
    assert not TENGraD(pm, lr=0.01, damping=0.1, orthogonalize=True).cuda_graph  # eigh: not capturable
    assert TENGraD(pm, lr=0.01, damping=0.1, orthogonalize="newton-schulz").cuda_graph


def test_gram_tf32_step_is_close_to_fp32() -> None:
    """TF32 Grams (``gram_tf32=True``) change the float32 steps by ~1e-3 relative at most."""
    ref, tf32 = _run("cuda", 5, cuda_graph=False), _run("cuda", 5, cuda_graph=False, gram_tf32=True)
    for a, b in zip(ref, tf32):
        torch.testing.assert_close(b, a, rtol=2e-2, atol=1e-3)


def test_cuda_orthogonalized_steps_equal_cpu() -> None:
    """``orthogonalize=True`` at the CUDA defaults (its eigendecomposition cannot be captured,
    so reuse steps run eagerly): five steps of each kind equal the float64 CPU run."""
    kw = dict(curvature_every=3, orthogonalize=True)
    cpu = _run("cpu", 5, dtype=torch.float64, **kw)
    gpu = _run("cuda", 5, dtype=torch.float64, **kw)
    for a, b in zip(cpu, gpu):
        torch.testing.assert_close(b, a, rtol=1e-7, atol=1e-9)



def test_cuda_newton_schulz_on_the_gram_equals_cpu() -> None:
    """A wide matrix's Newton–Schulz polar factor on its Gram (3C1F's hidden Linear takes
    that form; the test network's layers are too small for it) equals the CPU one (float64)."""
    from tengrad_fx.solve import newton_schulz_polar
    from tengrad_fx.solve.polar import GRAM_SIDE_MIN_SAVING, gram_side_saving

    assert gram_side_saving(256, 4096) >= GRAM_SIDE_MIN_SAVING
    m = torch.randn(256, 4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(newton_schulz_polar(m.cuda(), scale=0.3).cpu(), newton_schulz_polar(m, scale=0.3),
                               rtol=1e-10, atol=1e-12)
