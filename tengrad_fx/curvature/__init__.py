"""Curvature: exact per-layer Gram, Jv and Jᵀc from the captured I and G."""
from .layer import CoveredLayer, Strategy, choose_strategy, covered_layers, gram_flops

__all__ = ["CoveredLayer", "covered_layers", "Strategy", "gram_flops", "choose_strategy"]
