"""The one cost model: bytes (and, later, FLOPs) of every plan. Decisions and reports both use it."""

from fxmem.cost_model.memory import host_bytes, planned_bytes

__all__ = ["host_bytes", "planned_bytes"]
