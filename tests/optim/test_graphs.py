"""``cuda_graph=True`` on a CPU: the same code path (static gradient buffers, curvature
adopted into the previous tensors, the graph runner) runs eagerly and gives bit for bit
what ``cuda_graph=False`` gives. The CUDA replay is checked in ``test_cuda.py``."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tengrad_fx
from tengrad_fx import TENGraD
from tengrad_fx.optim.tengrad.cuda_graphs import GraphRunner, StepGraphs


def _run(cuda_graph: bool, schedule: bool = False, two_groups: bool = False, **kw):
    """7 steps (curvature every 3); ``schedule``: the lr changes at every step (each group
    its own with ``two_groups``). Returns the parameters, the optimizer, each step's groups."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                        nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.ReLU(), nn.Linear(8, 5))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(7)]
    pm = tengrad_fx.prepare(net, example_inputs=(data[0][0][:2],))
    if two_groups:
        ps = list(pm.parameters())
        kw["params"] = [dict(params=ps[:2]), dict(params=ps[2:], lr=0.02)]
    opt = TENGraD(pm, lr=0.05, damping=0.1, momentum=0.9, weight_decay=1e-3, kl_clip=1e-3,
                  curvature_every=3, cuda_graph=cuda_graph, **kw)
    base = [grp["lr"] for grp in opt.param_groups]
    groups = []
    for t, (x, y) in enumerate(data):
        if schedule:  # a decaying lr, as an lr scheduler sets it
            for grp, lr in zip(opt.param_groups, base):
                grp["lr"] = lr * (1.0 - 0.07 * t)
        opt.zero_grad()
        out = pm(x)
        torch.manual_seed(10 + t)
        opt.mc_capture(out)
        F.cross_entropy(out, y).backward()
        opt.step()
        groups.append(list(opt.curvature.groups))
    return [p.detach().clone() for p in pm.parameters()], opt, groups


@pytest.mark.parametrize("strategy", ["auto", "factor"])  # factor: the convs in stacked "conv" groups
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_cuda_graph_option_on_cpu_equals_eager_bit_for_bit(fisher: str, strategy: str) -> None:
    ref, _, _ = _run(False, fisher=fisher, strategy=strategy)
    got, opt, groups = _run(True, fisher=fisher, strategy=strategy)
    if strategy == "factor":
        assert sum(grp.form == "conv" for grp in groups[0]) == 2, [grp.form for grp in groups[0]]
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    graphs = opt.graph_runner.graphs
    assert graphs.eager_runs == 4 and graphs.replays == 0  # the 4 reuse steps went through it
    assert set(opt.graph_runner.grads) == set(opt.param_groups[0]["params"])  # static gradient buffers in use
    # the second and third curvature steps (t = 3, 6) copied into the first one's tensors
    assert all(a is b for a, b in zip(groups[0], groups[3])) and all(a is b for a, b in zip(groups[0], groups[6]))
    assert opt.counters == {"step": 7, "skipped": 0, "uncaptured": 0}


def test_cuda_graph_default_is_off_on_cpu() -> None:
    _, opt, _ = _run(None)
    assert opt.cuda_graph is False and not opt.graph_runner.grads


def test_step_graphs_stop_capturing_after_max_keys() -> None:
    """A damping that changes every step makes every key new: after MAX_KEYS warm-ups the
    runner gives up capturing (one warning) instead of capturing a graph per step. The
    warm-up of a key is eager, so no CUDA call is made before the cap."""
    graphs, calls = StepGraphs(), []
    dev = torch.device("cuda")
    for k in range(StepGraphs.MAX_KEYS):
        graphs.run(("reuse", k), lambda: calls.append(1), dev)
    assert not graphs.failed and graphs.eager_runs == StepGraphs.MAX_KEYS
    with pytest.warns(RuntimeWarning, match="step kinds"):
        graphs.run(("reuse", "new"), lambda: calls.append(1), dev)
    assert graphs.failed and len(calls) == StepGraphs.MAX_KEYS + 1 and not graphs.graphs


@pytest.mark.parametrize("two_groups", [False, True])
def test_lr_schedule_replays_one_graph_and_equals_eager(two_groups: bool) -> None:
    """An lr that changes at every step (with two groups, a different one per group, which
    takes the KL clip's weighted form): the graph path reads the lrs from static device
    scalars refilled before each run, so every reuse step has the same graph key (one graph
    for the whole schedule), and its steps equal ``cuda_graph=False``'s bit for bit."""
    ref, _, _ = _run(False, schedule=True, two_groups=two_groups)
    keys = []
    real_key = GraphRunner.key

    def spy(self, *args):
        keys.append(real_key(self, *args))
        return keys[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphRunner, "key", spy)
        got, opt, _ = _run(True, schedule=True, two_groups=two_groups)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert len(keys) == 4 and len(set(keys)) == 1  # the 4 reuse steps: one key
    assert float(opt.graph_runner.lrs[0]) == 0.05 * (1.0 - 0.07 * 5)  # the last reuse step's (t = 5) lr, exactly


def test_step_graphs_do_not_capture_a_step_that_reads_back() -> None:
    """A warm-up that reads a value back from the device (here ``.item()``) cannot be
    captured: it does not count as a warm-up; after MAX_SYNC_WARMUPS such runs the runner
    gives up (one warning naming the op) before any capture is tried. A sync-free warm-up
    of another key is seen."""
    graphs, dev = StepGraphs(), torch.device("cuda")
    t = torch.ones(2)
    for _ in range(StepGraphs.MAX_SYNC_WARMUPS - 1):
        graphs.run("reads", lambda: torch.tensor(t.sum().item()), dev)
    assert not graphs.failed and "reads" not in graphs.seen
    graphs.run("free", lambda: t * 2, dev)
    assert "free" in graphs.seen
    with pytest.warns(RuntimeWarning, match="_local_scalar_dense"):
        graphs.run("reads", lambda: torch.tensor(t.sum().item()), dev)
    assert graphs.failed and not graphs.graphs and graphs.eager_runs == StepGraphs.MAX_SYNC_WARMUPS + 1

