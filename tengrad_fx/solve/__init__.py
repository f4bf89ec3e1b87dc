"""Solve: the damped m×m systems of the Woodbury identity, batched across layers.

The one home of TENGraD's maths after the Grams: the damped factorization with its
jitter retries (:func:`damped_cholesky_ex`), the Woodbury / push-through coefficients
(:func:`woodbury_solve`, :func:`woodbury_coefficients`, :func:`woodbury_combine`) and the
push-through probe's rule (:func:`push_through_holds`), Grams of different sizes in one batch
(:func:`pad_gram`, :func:`pad_rows`), and the orthogonal polar factor of an
update (:func:`polar_factor`, exact; :func:`newton_schulz_polar`, Muon's matmul-only
approximation), and eigendecompositions with floored eigenvalues (:func:`floored_eigh`) with the
inverse square root of a base metric's Kronecker factor (:func:`root_inverse_sqrt`,
:func:`diagonal_root_inverse_sqrt`) and the change from one such factor to the next
(:func:`root_change`). Callers look these up here at call time (``solve.f(...)``).
"""
from .eigen import diagonal_root_inverse_sqrt, floored_eigh, root_change, root_inverse_sqrt
from .polar import NEWTON_SCHULZ_COEFFS, NEWTON_SCHULZ_STEPS, POLAR_FLOOR, newton_schulz_polar, polar_factor
from .probe import probe_tolerance, push_through_holds
from .ragged import pad_gram, pad_rows
from .woodbury import CholeskyFailed, damped_cholesky, damped_cholesky_ex, push_through_rhs, push_through_scale, \
    solve_cholesky, woodbury_apply, woodbury_coefficients, woodbury_combine, woodbury_push_through, \
    woodbury_solve

__all__ = ["damped_cholesky", "damped_cholesky_ex", "solve_cholesky", "woodbury_solve", "woodbury_coefficients",
           "woodbury_combine", "push_through_rhs", "push_through_scale", "woodbury_apply", "woodbury_push_through",
           "probe_tolerance", "push_through_holds", "CholeskyFailed", "POLAR_FLOOR", "polar_factor",
           "NEWTON_SCHULZ_COEFFS", "NEWTON_SCHULZ_STEPS", "newton_schulz_polar", "pad_gram", "pad_rows",
           "floored_eigh", "root_inverse_sqrt", "diagonal_root_inverse_sqrt", "root_change"]
