"""The plan: what happens to each saved tensor. Decided from the config; priced by the cost model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fxmem.analysis import Analysis
from fxmem.config import Config

Action = Literal["keep"]


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"action": self.action, "reason": self.reason}


def plan_region(analysis: Analysis, config: Config) -> list[Plan]:
    """One plan per saved tensor, in the analysis' order."""
    plans = []
    for saved in analysis.saved:
        if not saved.frees_memory:
            plans.append(Plan("keep", "frees nothing: not an activation"))
        elif saved.shares_storage_with is not None:
            plans.append(Plan("keep", f"shares storage with {saved.shares_storage_with}"))
        else:
            plans.append(Plan("keep", "no technique enabled" if not config.enabled_techniques()
                              else f"no enabled technique applies to {saved.role.value}"))
    return plans
