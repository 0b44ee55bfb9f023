"""Bytes a saved tensor takes under a plan."""

from __future__ import annotations

from fxmem.analysis import SavedTensor
from fxmem.policy import Plan


def planned_bytes(saved: SavedTensor, plan: Plan) -> int:
    """Bytes held between forward and backward once ``plan`` is applied to ``saved``."""
    if plan.action == "keep":
        return saved.nbytes
    raise ValueError(f"unknown plan action {plan.action!r}; valid actions: keep")
