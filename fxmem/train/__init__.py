"""Training-loop helpers that work with or without the fxmem backend."""

from fxmem.train import loqt
from fxmem.train.loqt import LoQT, LoQTConfig, LoQTLinear

__all__ = ["LoQT", "LoQTConfig", "LoQTLinear", "loqt"]
