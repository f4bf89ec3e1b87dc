"""Solve: the damped m×m systems of the Woodbury identity, batched across layers."""
from .woodbury import CholeskyFailed, damped_cholesky, damped_cholesky_ex, woodbury_apply, woodbury_push_through

__all__ = ["damped_cholesky", "damped_cholesky_ex", "woodbury_apply", "woodbury_push_through", "CholeskyFailed"]
