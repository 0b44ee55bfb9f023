"""A saved tensor's plan: the action the planner chose for it and what that action needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Action = Literal["keep", "quantize", "sparsify", "lowrank", "prenorm"]


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str
    bits: int | None = None  # quantize
    channels: int = 0  # quantize: channels with their own scale (the innermost memory dimension)
    outliers: int = 0  # quantize: channels kept in full precision
    outlier_values: float = 0.0  # quantize: fraction of the values kept exact beside the codes
    keep: int = 0  # sparsify: values kept per row
    rank: int = 0  # lowrank: rank of the factors of the (rows, last dimension) matrix
    exact_channels: int = 0  # prenorm: input channels (smallest |gamma|) saved exactly
    source: str | None = None  # the node compressed instead of the saved tensor (x before RoPE, a norm's output)
    nbytes: int | None = None  # bytes after the plan (cost model), None for keep

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, 0) or k in ("action", "reason")}
