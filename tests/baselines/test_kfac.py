"""K-FAC factors and steps against explicit float64 formulas (F.unfold, torch.kron)."""
from __future__ import annotations

import copy

import torch

import tengrad_fx
from tengrad_fx.optim.baselines._common import layer_stats
from tengrad_fx.optim.baselines.kfac import KFAC
from testing.tengrad_step import mc_labels

from ._helpers import (batch, cnn, explicit_factors, grad_matrix, prepared, reference_io, rel, snapshot,
                       split_matrix, step_delta)

TOL = 1e-10


def _loss_backward(model, x, y):
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def test_factors_match_unfold_formulas_and_kfac_pytorch_product():
    for bias2 in (True, False):
        net = cnn(bias2)
        x, y = batch(7, seed=1)
        template, model = prepared(net, x)
        opt = KFAC(model, lr=1.0, momentum=0.0, stat_decay=0.0, kl_clip=None)
        _loss_backward(model, x, y)
        io, _ = reference_io(snapshot(template, model), x, y)
        assert [b.layer.name for b in opt.blocks] == [str(i) for i in io]
        for blk, (_i, (inp, gout, mod)) in zip(opt.blocks, io.items()):
            st = layer_stats(blk)
            A, G, Aw, Gw = explicit_factors(mod, inp, gout)
            assert st.A.shape == A.shape and st.G.shape == G.shape
            assert rel(st.A, A) < TOL and rel(st.G, G) < TOL, blk.layer.name
            # same Kronecker product as alecwangcq/KFAC-Pytorch's conv/linear factors
            for k in range(A.shape[0]):
                assert rel(torch.kron(st.G[k], st.A[k]), torch.kron(Gw[k], Aw[k])) < TOL
            if isinstance(mod, torch.nn.Linear):
                assert rel(st.A, Aw) < TOL and rel(st.G, Gw) < TOL


def _dense_kfac(io, grads, damping):
    out = {}
    for i, (inp, gout, mod) in io.items():
        A, G, _, _ = explicit_factors(mod, inp, gout)
        gm = grad_matrix(mod, grads, str(i))
        us = []
        for k in range(A.shape[0]):
            n = A.shape[1] * G.shape[1]
            M = torch.kron(G[k], A[k]) + damping * torch.eye(n, dtype=A.dtype)
            us.append(torch.linalg.solve(M, gm[k].reshape(-1)).reshape(gm[k].shape))
        out.update(split_matrix(mod, torch.stack(us), str(i)))
    return out


def test_first_step_equals_dense_kronecker_solve():
    net = cnn()
    x, y = batch(6, seed=2)
    template, model = prepared(net, x)
    damping = 0.03
    opt = KFAC(model, lr=1.0, momentum=0.0, weight_decay=0.0, damping=damping, kl_clip=None)
    ref = snapshot(template, model)
    _loss_backward(model, x, y)
    io, grads = reference_io(ref, x, y)
    u = step_delta(model, opt)
    want = _dense_kfac(io, grads, damping)
    for name, w in want.items():
        assert rel(u[name], w) < 1e-9, name


def test_running_averages_and_inverse_schedule():
    net = cnn()
    template, model = prepared(net, batch(2)[0])
    opt = KFAC(model, lr=0.1, damping=0.1, momentum=0.0, stat_decay=0.7, kl_clip=None, curvature_every=1,
               inverse_every=2)
    seen = []
    for it in range(3):
        x, y = batch(5, seed=10 + it)
        ref = snapshot(template, model)
        _loss_backward(model, x, y)
        io, grads = reference_io(ref, x, y)
        seen.append({i: explicit_factors(mod, inp, g)[:2] for i, (inp, g, mod) in io.items()})
        eig_before = {i: e[0].clone() for i, e in opt.eig.items()}
        if it == 1:  # a curvature step that is not an inverse step: the previous basis is kept
            u = {n: d / 0.1 for n, d in step_delta(model, opt).items()}
            for i, e in opt.eig.items():
                assert torch.equal(e[0], eig_before[i])
            # the update uses step-0's eigenbasis of step-0's factors
            want = {}
            for _bi, (i, (_inp, _g, mod)) in enumerate(io.items()):
                A0, G0 = seen[0][i]
                gm = grad_matrix(mod, grads, str(i))
                us = [torch.linalg.solve(torch.kron(G0[k], A0[k]) + 0.1 * torch.eye(A0.shape[1] * G0.shape[1],
                      dtype=A0.dtype), gm[k].reshape(-1)).reshape(gm[k].shape) for k in range(A0.shape[0])]
                want.update(split_matrix(mod, torch.stack(us), str(i)))
            for name, w in want.items():
                assert rel(u[name], w) < 1e-9, name
        else:
            opt.step()
    for bi, i in enumerate(seen[0]):
        A = seen[0][i][0]
        for t in (1, 2):
            A = 0.7 * A + 0.3 * seen[t][i][0]
        assert rel(opt.factors[bi][0], A) < TOL


def test_capture_only_on_statistics_steps():
    net = cnn()
    x, y = batch(4)
    _, model = prepared(net, x)
    opt = KFAC(model, lr=0.01, curvature_every=3, inverse_every=3)
    store = tengrad_fx.get_info(model).store
    gens = []
    for _ in range(6):
        _loss_backward(model, x, y)
        gens.append(store.generation)
        opt.step()
    assert gens == [1, 1, 1, 2, 2, 2]
    assert opt.counters == {"step": 6, "skipped": 0, "uncaptured": 0}


def test_mc_fisher_uses_sampled_targets():
    net = cnn()
    x, y = batch(8, seed=3)
    template, model = prepared(net, x)
    opt = KFAC(model, lr=1.0, momentum=0.0, stat_decay=0.0, kl_clip=None, fisher="mc")
    model.zero_grad()
    out = model(x)
    loss = torch.nn.functional.cross_entropy(out, y)
    try:
        opt.step()
        raise AssertionError("expected RuntimeError without mc_capture")
    except RuntimeError as exc:
        assert "mc_capture" in str(exc)
    opt.seed_mc(5)
    opt.mc_capture(out)
    loss.backward()
    # the factors use G of the sampled labels; the update uses the true gradient
    y_mc = mc_labels(out, 5).reshape(-1)
    io_mc, _ = reference_io(snapshot(template, model), x, y_mc)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    u = {n: before[n] - p.detach() for n, p in model.named_parameters()}
    want = _dense_kfac(io_mc, grads, 0.001)
    for name, w in want.items():
        assert rel(u[name], w) < 1e-8, name


def test_nonfinite_gradient_skips_step():
    net = cnn()
    x, y = batch(4)
    _, model = prepared(net, x)
    opt = KFAC(model, lr=0.1)
    _loss_backward(model, x, y)
    next(model.parameters()).grad[0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    import warnings
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.counters == {"step": 0, "skipped": 1, "uncaptured": 0}


def test_linear_on_sequences_positions_and_repeated_calls():
    """Linear on ``[m, T, d]`` (tokens are positions), one module called twice (its calls'
    positions add up): A averages over samples and all positions, G sums over positions."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.b(torch.tanh(self.a(torch.tanh(self.a(x))))).mean(1)

    net = Net().double()
    x = torch.randn(5, 6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (5,))
    ref = copy.deepcopy(net)
    model = tengrad_fx.prepare(net, example_inputs=(x[:2],))
    opt = KFAC(model, lr=1.0, momentum=0.0, stat_decay=0.0, kl_clip=None, damping=0.01)
    _loss_backward(model, x, y)
    # reference: explicit forward with retained outputs
    h1 = ref.a(x)
    h1.retain_grad()
    t1 = torch.tanh(h1)
    h2 = ref.a(t1)
    h2.retain_grad()
    t2 = torch.tanh(h2)
    h3 = ref.b(t2)
    h3.retain_grad()
    torch.nn.functional.cross_entropy(h3.mean(1), y).backward()
    A1, G1 = [], []
    for inp, out in ((x, h1), (t1, h2)):
        A, G, _, _ = explicit_factors(ref.a, inp.detach(), out.grad)
        A1.append(A * inp.shape[1])  # sums over this call's positions
        G1.append(G)
    A_a = (A1[0] + A1[1]) / (2 * x.shape[1])
    G_a = G1[0] + G1[1]
    A_b, G_b, _, _ = explicit_factors(ref.b, t2.detach(), h3.grad)
    stats = {b.layer.name: layer_stats(b) for b in opt.blocks}
    assert rel(stats["a"].A, A_a) < TOL and rel(stats["a"].G, G_a) < TOL
    assert rel(stats["b"].A, A_b) < TOL and rel(stats["b"].G, G_b) < TOL
    u = step_delta(model, opt)
    for name, A, G, mod in (("a", A_a, G_a, ref.a), ("b", A_b, G_b, ref.b)):
        gm = grad_matrix(mod, {n: p.grad for n, p in ref.named_parameters()}, name)
        n = A.shape[1] * G.shape[1]
        want = torch.linalg.solve(torch.kron(G[0], A[0]) + 0.01 * torch.eye(n, dtype=A.dtype), gm[0].reshape(-1))
        got = torch.cat([u[f"{name}.weight"], u[f"{name}.bias"].unsqueeze(1)], 1)
        assert rel(got.reshape(-1), want) < 1e-9, name
