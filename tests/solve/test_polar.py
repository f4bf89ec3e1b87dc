"""The floored polar factor against the thin SVD's ``U diag(σ / max(σ, δσ₁)) Vᵀ`` (float64,
fresh random matrices: full rank, rank-deficient, with a singular value below the floor), and
the Newton–Schulz approximation against the SVD with its quintic applied to the singular values
(both of its forms: steps on ``X``, and on the Gram of a wide matrix)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tengrad_fx.solve import NEWTON_SCHULZ_STEPS, POLAR_FLOOR, newton_schulz_polar, \
    polar_factor
from tengrad_fx.solve import polar
from tengrad_fx.solve.polar import GRAM_SIDE_MIN_SAVING, _newton_schulz_direct, gram_side_saving
from tengrad_fx.utils.dispatch import SyncCounter
from testing.oracle import newton_schulz_reference


def svd_reference(m: torch.Tensor, floor: float = POLAR_FLOOR) -> torch.Tensor:
    left, sv, right = torch.linalg.svd(m, full_matrices=False)
    return left * (sv / sv.clamp(min=floor * sv[0])) @ right


@pytest.mark.parametrize("shape", [(5, 9), (9, 5), (7, 7), (1, 6)])
def test_full_rank_is_orthogonal_and_equals_svd(shape: tuple[int, int]) -> None:
    m = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))
    q = polar_factor(m)
    left, _, right = torch.linalg.svd(m, full_matrices=False)
    torch.testing.assert_close(q, left @ right, rtol=0, atol=1e-12)
    small = min(shape)
    torch.testing.assert_close(q @ q.mT if shape[0] <= shape[1] else q.mT @ q,
                               torch.eye(small, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_rank_deficient_and_small_singular_values(shape: tuple[int, int]) -> None:
    """Rank 3 plus a direction at 1e-5·σ₁ (below the floor: shrunk to 1e-2, not raised to 1)."""
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.linalg.qr(torch.randn(n, 4, dtype=torch.float64, generator=gen))[0] for n in shape)
    m = a * torch.tensor([3.0, 2.0, 0.5, 3e-5], dtype=torch.float64) @ b.mT
    torch.testing.assert_close(polar_factor(m), svd_reference(m), rtol=0, atol=1e-12)
    sv = torch.linalg.svdvals(polar_factor(m))
    torch.testing.assert_close(sv[:4], torch.tensor([1, 1, 1, 1e-2], dtype=torch.float64), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("shape", [(4, 11), (11, 4)])
def test_scale_is_folded_in(shape: tuple[int, int]) -> None:
    """``scale`` multiplies the result (applied inside, to the small factor)."""
    m = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(polar_factor(m, scale=2.5), 2.5 * svd_reference(m), rtol=0, atol=1e-12)


def test_zero_nonfinite_and_shape_errors() -> None:
    assert polar_factor(torch.zeros(3, 4)).abs().max() == 0
    assert polar_factor(torch.zeros(3, 4), scale=3.0).abs().max() == 0
    for bad in (float("nan"), float("inf"), -float("inf")):
        for shape in ((3, 5), (5, 3)):
            m = torch.randn(*shape)
            m[1, 2] = bad
            assert polar_factor(m).isnan().all() and polar_factor(m, scale=0.5).isnan().all()
    with pytest.raises(ValueError, match="2-D"):
        polar_factor(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_matches_float64(dtype: torch.dtype) -> None:
    """float32 to ~1e-4 of the float64 result; bfloat16 computed in float32, rounded once."""
    m = torch.randn(8, 20, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    q = polar_factor(m.to(dtype))
    assert q.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q.double(), polar_factor(m), rtol=0, atol=tol)


@pytest.fixture(params=["auto", "gram"])
def gram_side(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``"gram"``: every matrix the Gram form saves FLOPs on takes it, however small."""
    if request.param == "gram":
        monkeypatch.setattr(polar, "GRAM_SIDE_MIN_SAVING", 1)
    return str(request.param)


@pytest.mark.parametrize("shape", [(5, 9), (9, 5), (7, 7), (1, 6), (4, 30), (30, 4)])
@pytest.mark.parametrize("steps", [0, 1, NEWTON_SCHULZ_STEPS])
def test_newton_schulz_maps_singular_values_by_the_quintic(shape: tuple[int, int], steps: int, gram_side: str) -> None:
    m = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(11 + sum(shape)))
    torch.testing.assert_close(newton_schulz_polar(m, steps), newton_schulz_reference(m, steps), rtol=0, atol=1e-12)
    torch.testing.assert_close(newton_schulz_polar(m, scale=0.5), 0.5 * newton_schulz_reference(m),
                               rtol=0, atol=1e-12)


class _WideProducts(TorchDispatchMode):
    """Counts the matrix products with an operand of ``width`` columns (the ``A × A × B`` ones)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.count = width, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.count += any(isinstance(a, torch.Tensor) and self.width in a.shape for a in args)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("shape", [(6, 40), (40, 6)])
def test_newton_schulz_on_the_gram_equals_the_direct_steps_with_two_wide_products(
        shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A wide ``[A, B]`` iterates on its ``A × A`` Gram: the direct steps' result to 1e-13
    (float64; a low-rank matrix as a natural-gradient update of a wide layer is), with 2
    ``A × A × B`` products instead of 2 per step."""
    monkeypatch.setattr(polar, "GRAM_SIDE_MIN_SAVING", 1)
    gen = torch.Generator().manual_seed(13)
    a, b = min(shape), max(shape)
    assert gram_side_saving(a, b) > 0
    for m in (torch.randn(a, b, dtype=torch.float64, generator=gen),
              torch.randn(a, 3, dtype=torch.float64, generator=gen) @ torch.randn(3, b, dtype=torch.float64,
                                                                                   generator=gen)):
        x = m / torch.linalg.vector_norm(m)
        direct = _newton_schulz_direct(x, NEWTON_SCHULZ_STEPS, 0.7)
        m = m if shape[0] == a else m.mT.contiguous()
        with _WideProducts(b) as wp:
            q = newton_schulz_polar(m, scale=0.7)
        assert wp.count == 2
        torch.testing.assert_close(q if shape[0] == a else q.mT, direct, rtol=0, atol=1e-13)
    with _WideProducts(b) as wp:
        _newton_schulz_direct(x, NEWTON_SCHULZ_STEPS, 1.0)
    assert wp.count == 2 * NEWTON_SCHULZ_STEPS


@pytest.mark.parametrize("smallest", [1e-2, 1e-6])
def test_newton_schulz_float32_error_on_the_gram(smallest: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 on the Gram of a wide matrix: within 1e-3 (relative, Frobenius) of the float64
    steps for singular values spread down to ``smallest``·σ_max (about 3e-4 measured; the
    direct steps: 1e-5), so the cheaper form does not change a step's direction."""
    monkeypatch.setattr(polar, "GRAM_SIDE_MIN_SAVING", 1)
    gen = torch.Generator().manual_seed(3)
    a, b = 40, 400
    left = torch.linalg.qr(torch.randn(a, a, dtype=torch.float64, generator=gen))[0]
    right = torch.linalg.qr(torch.randn(b, a, dtype=torch.float64, generator=gen))[0]
    m = left * torch.logspace(0, torch.log10(torch.tensor(smallest)).item(), a, dtype=torch.float64) @ right.mT
    ref = newton_schulz_polar(m)
    err = torch.linalg.norm(newton_schulz_polar(m.float()).double() - ref) / torch.linalg.norm(ref)
    assert err < 1e-3, err


@pytest.mark.parametrize("shape", [(5, 9), (9, 5), (4, 30)])
def test_newton_schulz_batch_equals_each_matrix(shape: tuple[int, int], gram_side: str) -> None:
    """A batch ``[k, A, B]`` gives each matrix's own factor (each normalized by its own norm;
    a zero and a non-finite matrix in the batch stay 0 and NaN without touching the others)."""
    gen = torch.Generator().manual_seed(17)
    batch = torch.randn(4, *shape, dtype=torch.float64, generator=gen)
    batch[1] *= 1e3
    batch[2] = 0.0
    batch[3, 0, 0] = float("nan")
    q = newton_schulz_polar(batch, scale=0.4)
    assert q.shape == batch.shape
    for i in range(2):
        torch.testing.assert_close(q[i], newton_schulz_polar(batch[i], scale=0.4), rtol=0, atol=1e-13)
    assert q[2].abs().max() == 0 and q[3].isnan().all()


def test_gram_side_where_it_saves_enough() -> None:
    """The Gram form where it saves ≥ ``GRAM_SIDE_MIN_SAVING`` FLOPs: 3C1F's 500 × 10368 hidden
    Linear (under a third of the direct steps' FLOPs) and its 128 × 1600 conv, not its
    10 × 500 head or a square matrix."""
    direct = NEWTON_SCHULZ_STEPS * (4 * 500 ** 2 * 10368 + 2 * 500 ** 3)
    assert gram_side_saving(500, 10368) > 0.65 * direct
    assert gram_side_saving(128, 1600) >= GRAM_SIDE_MIN_SAVING
    assert gram_side_saving(10, 500) < GRAM_SIDE_MIN_SAVING
    assert gram_side_saving(64, 64) < 0


def test_newton_schulz_is_near_orthogonal_and_leaves_tiny_directions_small() -> None:
    """After five steps the singular values ≥ 1e-2·‖M‖ lie in [0.6, 1.25]; one at 1e-6 stays < 1e-2."""
    gen = torch.Generator().manual_seed(5)
    a, b = (torch.linalg.qr(torch.randn(n, 5, dtype=torch.float64, generator=gen))[0] for n in (8, 30))
    m = a * torch.tensor([3.0, 1.0, 0.3, 0.05, 3e-6], dtype=torch.float64) @ b.mT
    sv = torch.linalg.svdvals(newton_schulz_polar(m))
    assert ((sv[:4] > 0.6) & (sv[:4] < 1.25)).all(), sv
    assert sv[4] < 1e-2, sv


def test_newton_schulz_zero_nonfinite_dtype_and_shape_errors() -> None:
    for shape in ((3, 4), (3, 40)):  # the direct steps and the Gram's
        assert newton_schulz_polar(torch.zeros(shape)).abs().max() == 0
        m = torch.randn(shape[1], shape[0])
        m[1, 2] = float("nan")
        assert newton_schulz_polar(m).isnan().all()
    m = torch.randn(4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    q = newton_schulz_polar(m.to(torch.bfloat16))
    assert q.dtype == torch.bfloat16
    torch.testing.assert_close(q.double(), newton_schulz_polar(m), rtol=0, atol=3e-2)
    for bad in (torch.zeros(4), torch.zeros(2, 2, 3, 4)):
        with pytest.raises(ValueError, match=r"a matrix \[A, B\] or a batch \[k, A, B\]"):
            newton_schulz_polar(bad)


def test_only_the_eigensolver_reads_back() -> None:
    """The exact factor's eigensolver checks its status on the host; Newton–Schulz has no host read."""
    m = torch.randn(6, 10)
    with SyncCounter() as sc:
        newton_schulz_polar(m)
    assert sc.count == 0, dict(sc.ops)
    with SyncCounter() as sc:
        polar_factor(m)
    assert sc.count >= 1
