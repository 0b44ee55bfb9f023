"""Training-loop helpers that work with or without the fxmem backend."""

from fxmem.train.hift import ORDERS, HiFT, HiFTMemoryReport, LayerGroup, Unit, layer_units

__all__ = ["ORDERS", "HiFT", "HiFTMemoryReport", "LayerGroup", "Unit", "layer_units"]
