"""Capture: the FX pass that makes covered layers record their inputs and output grads."""
from .info import PrepareInfo, get_info
from .match import LayerSpec
from .prepare import prepare
from .switch import capturing

__all__ = ["prepare", "capturing", "get_info", "PrepareInfo", "LayerSpec"]
