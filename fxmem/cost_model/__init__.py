"""The one cost model: bytes (and, later, FLOPs) of every plan. Decisions and reports both use it."""

from fxmem.cost_model.memory import planned_bytes

__all__ = ["planned_bytes"]
