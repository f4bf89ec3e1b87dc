"""EKFAC against the dense eigenbasis formula with exact per-sample statistics (float64)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from testing import per_sample_grads_reference
from tengrad_fx.optim.baselines.ekfac import EKFAC, projected_second_moment

from ._helpers import (batch, cnn, explicit_factors, grad_matrix, prepared, reference_io, rel, snapshot, split_matrix,
                       step_delta)


def _dense_ekfac(io, grads, psg, damping):
    """``(U_G ⊗ U_A)(diag(s) + λ)⁻¹(U_G ⊗ U_A)ᵀ g`` per group, ``s`` from reference
    per-sample gradients projected into the eigenbasis of the explicit factors."""
    out, scales = {}, {}
    for i, (inp, gout, mod) in io.items():
        A, G, _, _ = explicit_factors(mod, inp, gout)
        gm = grad_matrix(mod, grads, str(i))
        g = A.shape[0]
        W = psg[f"{i}.weight"]
        m = W.shape[0]
        dW = W.reshape(m, g, W.shape[1] // g, -1)
        if mod.bias is not None:
            dW = torch.cat([dW, psg[f"{i}.bias"].reshape(m, g, -1, 1)], 3)
        us, ss = [], []
        for k in range(g):
            _, UA = torch.linalg.eigh(A[k])
            _, UG = torch.linalg.eigh(G[k])
            K = torch.kron(UG, UA)
            s = ((UG.T @ dW[:, k] @ UA) ** 2).mean(0)
            ss.append(s)
            u = K @ ((K.T @ gm[k].reshape(-1)) / (s.reshape(-1) + damping))
            us.append(u.reshape(gm[k].shape))
        out.update(split_matrix(mod, torch.stack(us), str(i)))
        scales[i] = torch.stack(ss)
    return out, scales


def test_exact_scalings_equal_dense_eigenbasis_formula():
    net = cnn()
    x, y = batch(9, seed=4)
    template, model = prepared(net, x)
    damping = 0.02
    opt = EKFAC(model, lr=1.0, momentum=0.0, weight_decay=0.0, damping=damping, kl_clip=None, stat_decay=0.0)
    ref = snapshot(template, model)
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    io, grads = reference_io(ref, x, y)
    psg = per_sample_grads_reference(snapshot(template, model), x, F.cross_entropy, y)
    u = step_delta(model, opt)
    want, scales = _dense_ekfac(io, grads, psg, damping)
    for bi, i in enumerate(io):
        assert rel(opt.scales[bi], scales[i]) < 1e-9
    for name, w in want.items():
        assert rel(u[name], w) < 1e-8, name


def test_scalings_schedule_and_reset_on_new_basis():
    net = cnn()
    x, y = batch(6, seed=5)
    _, model = prepared(net, x)
    opt = EKFAC(model, lr=0.05, stat_decay=0.5, curvature_every=4, rescale_every=2, inverse_every=4, kl_clip=None)
    for it in range(5):
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        s_prev = {i: s.clone() for i, s in opt.scales.items()}
        opt.step()
        if it in (0, 4):  # new basis: s restarts at d_G d_Aᵀ, then averages in this batch's estimate
            for i, (UA, dA, UG, dG) in opt.eig.items():
                est = projected_second_moment(opt.blocks[i], UA, UG)
                want = 0.5 * dG.unsqueeze(2) * dA.unsqueeze(1) + 0.5 * est
                assert rel(opt.scales[i], want) < 1e-12
        if it in (1, 3):  # neither a rescaling nor an inverse step: scalings untouched
            for i in s_prev:
                assert torch.equal(s_prev[i], opt.scales[i])
        if it == 2:  # a rescaling step only
            assert any(not torch.equal(s_prev[i], opt.scales[i]) for i in s_prev)
    assert all(torch.isfinite(p).all() for p in model.parameters())
