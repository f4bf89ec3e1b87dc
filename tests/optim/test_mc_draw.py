"""The MC Fisher's draw (:func:`tengrad_fx.optim.step.mc.sample_targets`): inverse CDF of
each position's softmax at a uniform drawn for its global index.

* label frequencies match the softmax (a chi-square bound over many draws, fixed seed); a
  class of zero probability is never drawn;
* masked positions get ``-100`` and their logits are not read; the kept positions' labels are
  the unmasked draw's;
* part ``r`` of a ``W``-part draw (``W = 2, 3``) is the slice ``r`` of the one-part draw of
  the concatenated batch, and every part leaves the generator in the one-part draw's state
  (cross-entropy and mse).
"""
from __future__ import annotations

import pytest
import torch

from tengrad_fx.optim.step.mc import sample_targets

N = 20000  # draws per row


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_frequencies_match_the_softmax(dtype: torch.dtype) -> None:
    logits = torch.tensor([[0.3, -1.2, 2.0, 0.0, float("-inf")],
                           [5.0, 5.0, -3.0, 1.0, 0.5],
                           [-0.7, 0.1, 0.4, -2.5, 1.3]], dtype=torch.float64)
    p = torch.softmax(logits.to(dtype).double(), -1)
    gen = torch.Generator().manual_seed(7)
    labels = sample_targets(logits.to(dtype).expand(N, -1, -1), "cross_entropy", gen)  # [N, 3]
    assert labels.shape == (N, 3) and labels.dtype == torch.int64
    for row in range(3):
        counts = torch.bincount(labels[:, row], minlength=5).double()
        assert counts.numel() == 5
        live = p[row] > 0
        assert (counts[~live] == 0).all(), f"row {row}: a class of zero probability was drawn"
        want = N * p[row][live]
        chi2 = ((counts[live] - want) ** 2 / want).sum().item()
        assert chi2 < 25.0, f"row {row}: chi-square {chi2:.1f} over {int(live.sum()) - 1} degrees of freedom"


def test_masked_positions_are_minus_100_and_not_read() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 6, 5, dtype=torch.float64, generator=gen)
    mask = torch.rand(4, 6, generator=gen) > 0.4
    mask[0, 0] = False
    bad = logits.clone()
    bad[~mask] = float("nan")  # masked logits are not read
    state = gen.get_state()
    plain = sample_targets(logits, "cross_entropy", gen)
    gen.set_state(state)
    masked = sample_targets(bad, "cross_entropy", gen, mask)
    assert (masked[~mask] == -100).all()
    assert torch.equal(masked[mask], plain[mask])
    assert ((plain >= 0) & (plain < 5)).all()


def test_non_finite_rows_are_drawn_in_range() -> None:
    logits = torch.zeros(3, 4, dtype=torch.float64)
    logits[0] = float("nan")
    logits[1] = float("-inf")
    logits[2, 1] = float("inf")
    labels = sample_targets(logits, "cross_entropy", torch.Generator().manual_seed(0))
    assert ((labels >= 0) & (labels < 4)).all()


def _draw(outputs: torch.Tensor, kind: str, state: torch.Tensor, mask: torch.Tensor | None, part: int, parts: int,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator()
    gen.set_state(state)
    return sample_targets(outputs, kind, gen, mask, part, parts), gen.get_state()  # type: ignore[arg-type]


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("kind, masked", [("cross_entropy", False), ("cross_entropy", True), ("mse", False)])
def test_a_part_is_the_slice_of_the_whole_draw(parts: int, kind: str, masked: bool) -> None:
    g = torch.Generator().manual_seed(11)
    m, L, c = 2, 5, 7
    outputs = torch.randn(parts * m, L, c, dtype=torch.float64, generator=g)
    mask = torch.rand(parts * m, L, generator=g) > 0.3 if masked else None
    state = torch.Generator().manual_seed(5).get_state()
    whole, after = _draw(outputs, kind, state, mask, 0, 1)
    for r in range(parts):
        rows = slice(r * m, (r + 1) * m)
        got, after_r = _draw(outputs[rows], kind, state, None if mask is None else mask[rows], r, parts)
        assert torch.equal(got, whole[rows]), f"part {r} of {parts}: other labels than the whole draw's slice"
        assert torch.equal(after_r, after), f"part {r} of {parts}: the generator advanced otherwise"
    if kind == "cross_entropy":  # and the parts do differ from a one-part draw of their own batch
        alone, _ = _draw(outputs[m:2 * m], kind, state, None if mask is None else mask[m:2 * m], 0, 1)
        assert not torch.equal(alone, whole[m:2 * m])
