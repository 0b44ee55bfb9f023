"""A saved tensor's plan: the action the planner chose for it and what that action needs."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from enum import Enum

from torch.fx import Node

from fxmem.analysis.norm import NormUnit
from fxmem.analysis.rope import Replay


class Action(str, Enum):
    """What a plan does with a saved tensor (a str: reports and golden plans write its value)."""

    KEEP = "keep"
    RECOMPUTE = "recompute"  # a chain of forward ops replayed in backward
    QUANTIZE = "quantize"
    SPARSIFY = "sparsify"
    LOWRANK = "lowrank"
    PRENORM = "prenorm"  # a norm's input rebuilt from its output's stored form
    CHECKPOINT = "checkpoint"  # inside a block memory_budget checkpoints: recomputed with it (backend.py)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


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
    host: bool = False  # what is stored waits in host memory between forward and backward (block_offload)
    # Graph references (left out of comparisons: plans of two compilations of one model compare equal)
    replay: Replay | None = field(default=None, compare=False)  # quantize, lowrank: compress its source instead
    norm: NormUnit | None = field(default=None, compare=False)  # prenorm: whose output rebuilds the input
    chain: tuple[Node, ...] = field(default=(), compare=False)  # recompute: the forward ops backward replays
    # the node compressed instead of the saved tensor (x before RoPE or a repeat, a norm's output), by name: set from
    # replay or norm, and kept in the record without them
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action(self.action))  # frozen: a plan named by its value is typed
        if self.source is None and (self.replay is not None or self.norm is not None):
            node = self.replay.source if self.replay is not None else self.norm.output
            object.__setattr__(self, "source", node.name)  # frozen: set once, as it is made

    def record(self) -> Plan:
        """The plan as the report keeps it: without the graph references, which would keep the region's graphs
        (and their fake tensors) alive as long as the report."""
        return replace(self, replay=None, norm=None, chain=())

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("replay", "norm", "chain")}
        data["action"] = self.action.value
        return {k: v for k, v in data.items() if v not in (None, 0, False) or k in ("action", "reason")}
