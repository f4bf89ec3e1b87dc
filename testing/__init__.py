"""Shared test helpers (not part of the installed wheel): float64 oracles from torch.func."""
from .oracle import (
    check_covered_layers,
    check_tengrad_step,
    dense_layer_updates,
    explicit_jacobian,
    output_jacobians_reference,
    per_sample_grads_reference,
)

__all__ = [
    "per_sample_grads_reference",
    "explicit_jacobian",
    "dense_layer_updates",
    "output_jacobians_reference",
    "check_tengrad_step",
    "check_covered_layers",
]
