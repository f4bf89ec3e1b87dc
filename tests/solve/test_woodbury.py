"""``tengrad_fx.solve``: batched damped Cholesky (with jitter retries) and the two
Woodbury forms against a dense float64 ``solve(JᵀJ/m + αI, g)``."""
from __future__ import annotations

import pytest
import torch

from tengrad_fx.solve import CholeskyFailed, damped_cholesky, damped_cholesky_ex, woodbury, woodbury_apply, \
    woodbury_push_through
from tengrad_fx.solve.woodbury import JITTERS


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def _psd(L: int, m: int, rank: int, dtype=torch.float64) -> torch.Tensor:
    """``[L, m, m]`` Grams ``J Jᵀ`` of rank ``rank`` (rank < m: singular without damping)."""
    J = torch.randn(L, m, rank, dtype=dtype)
    return J @ J.transpose(1, 2)


def _dense_u(J: torch.Tensor, g: torch.Tensor, alpha: float) -> torch.Tensor:
    m, n = J.shape
    return torch.linalg.solve(J.T @ J / m + alpha * torch.eye(n, dtype=J.dtype), g)


# --------------------------------------------------------------------------- damped_cholesky
@pytest.mark.parametrize("per_matrix_shift", [False, True])
def test_batched_equals_per_matrix(per_matrix_shift: bool) -> None:
    torch.manual_seed(0)
    L, m = 5, 7
    K = _psd(L, m, rank=3)
    shift = torch.tensor([0.1, 1.0, 1e-3, 2.5, 0.7], dtype=torch.float64) if per_matrix_shift else 0.3
    chol = damped_cholesky(K, shift)
    assert chol.shape == (L, m, m)
    for i in range(L):
        s = float(shift[i]) if per_matrix_shift else shift
        one = damped_cholesky(K[i], s)
        assert one.shape == (m, m)
        torch.testing.assert_close(chol[i], one, rtol=1e-13, atol=1e-13)
        direct = torch.linalg.cholesky(K[i] + s * torch.eye(m, dtype=K.dtype))
        torch.testing.assert_close(chol[i], direct, rtol=1e-12, atol=1e-12)
        assert torch.equal(chol[i], torch.tril(chol[i]))  # lower factor


def test_solve_dtype_upcasts() -> None:
    torch.manual_seed(1)
    K = _psd(3, 6, rank=6, dtype=torch.float32)
    chol = damped_cholesky(K, 0.5, dtype=torch.float64)
    assert chol.dtype == torch.float64
    ref = torch.linalg.cholesky(K.double() + 0.5 * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(chol, ref, rtol=1e-12, atol=1e-12)
    assert K.dtype == torch.float32  # the input is not modified


def test_jitter_rescues_tiny_negative_eigenvalue_only_where_needed() -> None:
    torch.manual_seed(2)
    m = 6
    Q, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64))
    lam = torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, -1e-9], dtype=torch.float64)
    bad = Q @ torch.diag(lam) @ Q.T
    bad = (bad + bad.T) / 2
    with pytest.raises(RuntimeError):
        torch.linalg.cholesky(bad)  # indefinite as given
    good = _psd(1, m, rank=m)[0] + torch.eye(m, dtype=torch.float64)
    K = torch.stack([good, bad, good * 2])
    chol = damped_cholesky(K, 0.0)
    assert torch.isfinite(chol).all()
    # healthy matrices are untouched by the retry of the bad one
    torch.testing.assert_close(chol[0], torch.linalg.cholesky(good), rtol=0, atol=0)
    torch.testing.assert_close(chol[2], torch.linalg.cholesky(good * 2), rtol=0, atol=0)
    # the rescued one is the factor of bad + (small jitter)·I
    rec = chol[1] @ chol[1].T
    jit = (rec - bad).diagonal()
    assert (jit > 0).all() and jit.max() < 1e-4 * bad.diagonal().abs().mean()
    torch.testing.assert_close(rec - torch.diag(jit), bad, rtol=0, atol=1e-12)


def test_nan_gram_raises() -> None:
    K = _psd(2, 4, rank=4)
    K[1, 0, 2] = float("nan")
    with pytest.raises(CholeskyFailed):
        damped_cholesky(K, 0.1)
    with pytest.raises(CholeskyFailed):
        damped_cholesky(torch.full((3, 3), float("inf"), dtype=torch.float64), 0.1)


def test_hopeless_gram_raises_after_retries() -> None:
    K = -torch.eye(4, dtype=torch.float64)  # jitter sums to ~0.11·|diag|: never enough
    with pytest.raises(CholeskyFailed, match="jitter"):
        damped_cholesky(K, 0.0)
    assert issubclass(CholeskyFailed, RuntimeError)


def _reference_cholesky_ex(K: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The retry rule written per matrix: ``K_b + shift_b·I``, then each jitter of
    ``JITTERS`` (times ``mean|diag|`` of that damped Gram) until a factor exists."""
    chols, oks = [], []
    for Kb, s in zip(K, shift):
        A = Kb + s * torch.eye(K.shape[-1], dtype=K.dtype)
        scale = A.diagonal().abs().mean().clamp_min(torch.finfo(K.dtype).tiny)
        chol, info = torch.linalg.cholesky_ex(A)
        ok = int(info) == 0
        for jitter in JITTERS:
            if ok:
                break
            chol, info = torch.linalg.cholesky_ex(A + (jitter * scale) * torch.eye(K.shape[-1], dtype=K.dtype))
            ok = int(info) == 0
        chols.append(chol)
        oks.append(ok and bool(torch.isfinite(A).all()))
    return torch.stack(chols), torch.tensor(oks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("path", ["one call", "one per try", "host retries"])
def test_cholesky_ex_tries_equal_the_rule_per_matrix(monkeypatch, dtype: torch.dtype, path: str) -> None:
    """All tries in one batched ``cholesky_ex`` (or, beyond ``TRIES_BYTES``, one per try;
    or, on a CPU, retries for the failed matrices only) give each matrix the factor of its
    first successful try, as the rule written per matrix does: healthy ones bit for bit,
    rescued ones by the same jitter; ``ok`` False for the hopeless and the non-finite ones only."""
    monkeypatch.setattr(woodbury, "HOST_RETRIES", path == "host retries")
    if path == "one per try":
        monkeypatch.setattr(woodbury, "TRIES_BYTES", 0)
    torch.manual_seed(3)
    m = 6
    Q, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64))
    tiny_neg = Q @ torch.diag(torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, -1e-7], dtype=torch.float64)) @ Q.T
    needs_big = Q @ torch.diag(torch.tensor([3.0, 2.0, 1.5, 1.0, 0.5, -0.05], dtype=torch.float64)) @ Q.T
    nan = _psd(1, m, rank=m)[0]
    nan[0, 3] = float("nan")
    K = torch.stack([_psd(1, m, rank=m)[0], (tiny_neg + tiny_neg.T) / 2, (needs_big + needs_big.T) / 2,
                     -torch.eye(m, dtype=torch.float64), nan, _psd(1, m, rank=2)[0]]).to(dtype)
    shift = torch.tensor([0.1, 0.0, 0.0, 0.0, 0.1, 0.3], dtype=dtype)
    chol, ok = damped_cholesky_ex(K, shift)
    ref, ref_ok = _reference_cholesky_ex(K, shift)
    assert ok.tolist() == ref_ok.tolist() == [True, True, True, False, False, True]
    for b in (0, 1, 2, 5):
        torch.testing.assert_close(chol[b], ref[b], rtol=0, atol=0)
    assert torch.equal(chol[0], torch.linalg.cholesky(K[0] + 0.1 * torch.eye(m, dtype=dtype)))
    # a scalar shift and one matrix take the same path
    one, one_ok = damped_cholesky_ex(K[5], 0.3)
    assert bool(one_ok) and torch.equal(one, chol[5])


# --------------------------------------------------------------------------- Woodbury forms
@pytest.mark.parametrize("m,n", [(6, 20), (1, 5), (12, 7)])  # wide, single sample, tall (m > n)
@pytest.mark.parametrize("alpha", [1e-3, 0.1, 10.0])
def test_woodbury_apply_matches_dense(m: int, n: int, alpha: float) -> None:
    torch.manual_seed(3)
    J = torch.randn(m, n, dtype=torch.float64)
    g = torch.randn(n, dtype=torch.float64)
    chol = damped_cholesky(J @ J.T, m * alpha)
    u = woodbury_apply(chol, g, alpha, lambda v: J @ v, lambda c: J.T @ c)
    assert u.shape == (n,) and u.dtype == torch.float64
    assert rel(u, _dense_u(J, g, alpha)) < 1e-9


@pytest.mark.parametrize("m,n", [(6, 20), (1, 5), (12, 7)])
@pytest.mark.parametrize("alpha", [1e-3, 0.1, 10.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_push_through_matches_dense(m: int, n: int, alpha: float, reduction: str) -> None:
    torch.manual_seed(4)
    J = torch.randn(m, n, dtype=torch.float64)
    s_g = 1.0 / m if reduction == "mean" else 1.0  # g = s_g · Jᵀ1
    g = s_g * J.T @ torch.ones(m, dtype=torch.float64)
    chol = damped_cholesky(J @ J.T, m * alpha)
    u = woodbury_push_through(chol, s_g * m, lambda c: J.T @ c)
    ref = _dense_u(J, g, alpha)
    assert rel(u, ref) < 1e-9
    u_gen = woodbury_apply(chol, g, alpha, lambda v: J @ v, lambda c: J.T @ c)
    assert rel(u, u_gen) < 1e-9


def test_float32_operands_with_float64_factor() -> None:
    torch.manual_seed(5)
    m, n, alpha = 8, 30, 0.05
    J = torch.randn(m, n)
    g = torch.randn(n)
    chol = damped_cholesky(J @ J.T, m * alpha, dtype=torch.float64)
    u = woodbury_apply(chol, g, alpha, lambda v: J @ v, lambda c: J.T @ c.to(J.dtype))
    assert u.dtype == torch.float32
    assert rel(u.double(), _dense_u(J.double(), g.double(), alpha)) < 1e-5


def test_cholesky_ex_dispatches_a_fixed_handful_of_ops() -> None:
    """On a device (and under the counter, which stands in for one) every try is one batched
    ``cholesky_ex``: the kernels dispatched do not grow with the batch (the loop over tries
    was 41 kernels, 4 of them ``cholesky_ex``; now 17)."""
    from tengrad_fx.utils.dispatch import OpCounter

    counts = []
    for B in (1, 9):
        K = _psd(B, 5, rank=5, dtype=torch.float32)
        damped_cholesky_ex(K, 0.1)  # warm: the identity and the jitters are made once
        with OpCounter() as oc:
            damped_cholesky_ex(K, 0.1)
        counts.append(oc.kernels)
        assert oc.ops["aten.linalg_cholesky_ex.default"] == 1, oc.ops
    assert counts[0] == counts[1] <= 20, counts


def test_cpu_factorizes_healthy_grams_once(monkeypatch) -> None:
    """On a CPU, healthy Grams take one ``cholesky_ex`` over ``[B, m, m]`` (not the ``[T·B,
    m, m]`` of every try) and the same bits as the device path; a failing one is retried
    alone until the first jitter that works."""
    torch.manual_seed(6)
    K = _psd(9, 5, rank=5, dtype=torch.float32)
    Q, _ = torch.linalg.qr(torch.randn(5, 5))
    K[4] = Q @ torch.diag(torch.tensor([3.0, 2.0, 1.0, 0.5, -0.05])) @ Q.T
    K[4] = (K[4] + K[4].T) / 2  # indefinite: only the largest jitter rescues it
    shapes: list[tuple[int, ...]] = []
    orig = torch.linalg.cholesky_ex

    def spy(A, *a, **k):
        shapes.append(tuple(A.shape))
        return orig(A, *a, **k)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", spy)
    chol, ok = damped_cholesky_ex(K, 0.0)
    assert shapes == [(9, 5, 5), (1, 5, 5), (1, 5, 5), (1, 5, 5)], shapes
    monkeypatch.setattr(woodbury, "HOST_RETRIES", False)
    dev, dev_ok = damped_cholesky_ex(K, 0.0)
    assert shapes[4] == (4, 9, 5, 5), shapes
    assert ok.tolist() == dev_ok.tolist() == [True] * 9
    assert torch.equal(chol, dev) and chol.is_contiguous()
    # a dispatch mode watching (the sync counter) sees the device path: no host read
    from tengrad_fx.utils.dispatch import SyncCounter

    monkeypatch.setattr(woodbury, "HOST_RETRIES", True)
    with SyncCounter() as sc:
        watched, _ = damped_cholesky_ex(K, 0.0)
    assert sc.count == 0 and shapes[5] == (4, 9, 5, 5) and torch.equal(watched, chol), (sc.ops, shapes)
