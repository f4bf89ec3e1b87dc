"""``tengrad_fx.solve``: batched damped Cholesky (with jitter retries) and the two
Woodbury forms against a dense float64 ``solve(JᵀJ/m + αI, g)``."""
from __future__ import annotations

import pytest
import torch

from tengrad_fx.solve import CholeskyFailed, damped_cholesky, woodbury_apply, woodbury_push_through


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
