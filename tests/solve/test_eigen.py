"""``solve.root_inverse_sqrt`` / ``diagonal_root_inverse_sqrt``: ``S = D_M^{-1/2}``,
``D_M = M^{1/2}`` normalized to mean eigenvalue 1, eigenvalues of ``M^{1/2}`` floored at
``floor`` of the largest, in float64 against an SVD of ``M``; a batch equals its matrices one
by one; a non-finite or zero ``M`` gives the identity, never NaN."""
from __future__ import annotations

import torch

from tengrad_fx.solve import diagonal_root_inverse_sqrt, root_inverse_sqrt


def _reference(moment: torch.Tensor, floor: float) -> torch.Tensor:
    u, sv, _ = torch.linalg.svd(moment)
    root = sv.sqrt().clamp(min=floor * sv[0].sqrt())
    d = root / root.mean()
    return (u * d.rsqrt()) @ u.T


def test_root_inverse_sqrt_equals_svd_reference_and_batches() -> None:
    """Rank-deficient (rank 3 of 7) and full-rank moments, one by one and as a batch;
    ``S⁻²`` has mean eigenvalue 1."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 3, generator=g, dtype=torch.float64)
    b = torch.randn(7, 20, generator=g, dtype=torch.float64)
    moments = torch.stack([a @ a.T, b @ b.T])
    batch = root_inverse_sqrt(moments, 1e-2)
    for moment, s in zip(moments, batch):
        ref = _reference(moment, 1e-2)
        torch.testing.assert_close(s, ref, rtol=0, atol=1e-10)
        torch.testing.assert_close(root_inverse_sqrt(moment, 1e-2), s, rtol=0, atol=1e-12)
        lam = torch.linalg.eigvalsh(torch.linalg.inv(s @ s))  # of D_M
        assert abs(lam.mean().item() - 1.0) < 1e-10 and lam[0] >= 1e-2 * lam[-1] * (1 - 1e-9)
    lam = torch.linalg.eigvalsh(torch.linalg.inv(batch[0] @ batch[0]))  # rank 3: four floored
    torch.testing.assert_close(lam[:4], torch.full((4,), 1e-2, dtype=torch.float64) * lam[-1], rtol=1e-9, atol=0)


def test_diagonal_matches_the_full_form_of_a_diagonal_moment() -> None:
    r = torch.tensor([4.0, 1e-9, 0.25, 9.0], dtype=torch.float64)
    s = diagonal_root_inverse_sqrt(r, 1e-3)
    torch.testing.assert_close(torch.diag(s), root_inverse_sqrt(torch.diag(r), 1e-3), rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.diag(s), _reference(torch.diag(r), 1e-3), rtol=0, atol=1e-12)


def test_non_finite_or_zero_moment_gives_identity() -> None:
    eye = torch.eye(3, dtype=torch.float64)
    bad = eye.clone()
    bad[0, 1] = float("nan")
    out = root_inverse_sqrt(torch.stack([bad, torch.zeros(3, 3, dtype=torch.float64), 2 * eye]), 1e-3)
    for s in out:
        torch.testing.assert_close(s, eye, rtol=0, atol=1e-12)
    vec = torch.tensor([[1.0, float("inf"), 2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(diagonal_root_inverse_sqrt(vec, 1e-3), torch.ones(2, 3), rtol=0, atol=1e-6)
    assert root_inverse_sqrt(torch.ones(2, 2, dtype=torch.float16), 1e-3).dtype == torch.float16
