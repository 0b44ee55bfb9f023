"""A saved tensor's plan: the action the planner chose for it and what that action needs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

from torch.fx import Node

from fxmem.analysis.norm import NormUnit
from fxmem.analysis.rope import Replay

Action = Literal["keep", "recompute", "quantize", "sparsify", "lowrank", "prenorm"]


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str
    bits: int | None = None  # quantize; prenorm: the output's, when its codes rebuild the input
    channels: int = 0  # quantize: channels with their own scale (the innermost memory dimension, or ``merged``)
    merged: int = 0  # quantize: innermost memory dimensions flattened into the channels (0: the innermost alone)
    outliers: int = 0  # quantize: channels kept in full precision
    chunk: int = 0  # quantize: each row keeps one value exact per chunk of this many channels (0: none)
    rotation: int = 0  # quantize: rows rotated in Hadamard blocks of this many channels (0: none)
    stochastic: bool = False  # quantize: codes rounded stochastically
    keep_positive: bool = False  # quantize: positive values stay positive, zero zero (its backward reads which are)
    keep: int = 0  # sparsify: values kept per row
    rank: int = 0  # lowrank: rank of the factors of the (rows, last dimension) matrix; prenorm: the output's
    exact_channels: int = 0  # prenorm: input channels (smallest |gamma|) saved exactly
    nbytes: int | None = None  # bytes after the plan (cost model), None for keep
    seconds: float = 0.0  # what the plan adds to a step (cost model): its price against the bytes it saves
    # Graph references (left out of comparisons: plans of two compilations of one model compare equal)
    replay: Replay | None = field(default=None, compare=False)  # quantize, lowrank: compress its source instead
    norm: NormUnit | None = field(default=None, compare=False)  # prenorm: whose output rebuilds the input
    chain: tuple[Node, ...] = field(default=(), compare=False)  # recompute: the forward ops backward replays

    @property
    def source(self) -> Node | None:
        """The node compressed instead of the saved tensor: x before RoPE or a repeat, or a norm's output."""
        if self.replay is not None:
            return self.replay.source
        return self.norm.output if self.norm is not None else None

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("replay", "norm", "chain")}
        data["source"] = self.source.name if self.source is not None else None
        return {k: v for k, v in data.items() if v not in (None, 0, False) or k in ("action", "reason")}
