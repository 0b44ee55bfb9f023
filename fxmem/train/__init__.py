"""Training-loop helpers that work with or without the fxmem backend."""

from fxmem.train import loqt
from fxmem.train.hift import ORDERS, HiFT, HiFTMemoryReport, LayerGroup, Unit, layer_units
from fxmem.train.loqt import LoQT, LoQTConfig, LoQTLinear

__all__ = ["ORDERS", "HiFT", "HiFTMemoryReport", "LayerGroup", "LoQT", "LoQTConfig", "LoQTLinear", "Unit",
           "layer_units", "loqt"]
