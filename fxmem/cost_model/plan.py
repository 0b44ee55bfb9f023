"""A saved tensor's plan: one class per action, each with only the fields its rewrite reads.

``Keep``, ``Quantize`` and ``LowRank`` store something in the step's memory; their ``host`` says it waits in host
memory instead between forward and backward (block_offload). Offloading is a placement of what a plan stores, not a
way to store it, so it is a field of those three and not a class of its own.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, fields, replace
from enum import Enum
from typing import Any, ClassVar

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
    CHECKPOINT = "checkpoint"  # inside a block memory_budget checkpoints: recomputed with it (pipeline.py)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class RaisedFor(Enum):
    """What backward rebuilds from a storage an option raises to REBUILD_SOURCE_BITS (cost_model/options.py); the
    value as its reason names it, the X W where it serves both."""

    REPLAYED_X_W = "an X W"
    NORM_INPUT = "its norm's input"


# Graph references: left out of comparisons (plans of two compilations of one model compare equal), of the record the
# report keeps (they would keep the region's graphs and fake tensors alive) and of to_dict.
_GRAPH_REFERENCES = ("replay", "norm", "chain")


@dataclass(frozen=True)
class Plan:
    """What every plan has: why it was chosen, and what the cost model says it stores and costs."""

    action: ClassVar[Action]  # set by each subclass: Plan itself is abstract
    reason: str
    _: KW_ONLY
    nbytes: int | None = None  # bytes after the plan (cost model), None for keep
    seconds: float = 0.0  # what the plan adds to a step (cost model): its price against the bytes it saves
    host: ClassVar[bool] = False  # only what stores something can wait in host memory (Keep, Quantize, LowRank)

    def __post_init__(self) -> None:
        if type(self) is Plan:
            raise TypeError("Plan is abstract: make one of its subclasses (Keep, Recompute, Quantize, Sparsify, "
                            "LowRank, RebuildNormInput, Checkpoint)")

    def record(self) -> Plan:
        """The plan as the report keeps it, without graph references."""
        return replace(self, **{f.name: f.default for f in fields(self) if f.name in _GRAPH_REFERENCES})

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _GRAPH_REFERENCES}
        return {"action": self.action.value,
                **{k: v for k, v in data.items() if v not in (None, 0, False, "") or k == "reason"}}


def _set_source(plan: Plan, node: Node | None) -> None:
    """Names, in ``plan.source``, the node compressed instead of the saved tensor (x before RoPE or a repeat, a
    norm's output): set once, as the plan is made, and kept in its record without the graph references."""
    if plan.source is None and node is not None:
        object.__setattr__(plan, "source", node.name)  # frozen


@dataclass(frozen=True, kw_only=True)
class _Stored(Plan):
    """A plan that stores something between forward and backward, which may wait in host memory instead."""

    host: bool = False


@dataclass(frozen=True, kw_only=True)
class _Compressed(_Stored):
    """Codes or factors, of the saved tensor or of the source it is replayed from (x before RoPE or a repeat)."""

    replay: Replay | None = field(default=None, compare=False)  # compress its source instead
    source: str | None = field(default=None, compare=False)  # replay's source, by name: kept in the record

    def __post_init__(self) -> None:
        _set_source(self, self.replay.source if self.replay is not None else None)


@dataclass(frozen=True, kw_only=True)
class Keep(_Stored):
    action: ClassVar[Action] = Action.KEEP


@dataclass(frozen=True, kw_only=True)
class Recompute(Plan):
    """Rebuilt in backward by replaying a chain of forward ops."""

    action: ClassVar[Action] = Action.RECOMPUTE
    chain: tuple[Node, ...] = field(default=(), compare=False)  # the forward ops backward replays


@dataclass(frozen=True, kw_only=True)
class Quantize(_Compressed):
    action: ClassVar[Action] = Action.QUANTIZE
    bits: int
    channels: int  # channels with their own scale (the innermost memory dimension, or ``merged``)
    merged: int = 0  # innermost memory dimensions flattened into the channels (0: the innermost alone)
    outliers: int = 0  # channels kept in full precision
    chunk: int = 0  # each row keeps one value exact per chunk of this many channels (0: none)
    rotation: int = 0  # rows rotated in Hadamard blocks of this many channels (0: none)
    stochastic: bool = False  # codes rounded stochastically
    keep_positive: bool = False  # positive values stay positive, zero zero (its backward reads which are)


@dataclass(frozen=True, kw_only=True)
class Sparsify(Plan):
    action: ClassVar[Action] = Action.SPARSIFY
    kept_per_row: int  # the largest values each row keeps


@dataclass(frozen=True, kw_only=True)
class LowRank(_Compressed):
    action: ClassVar[Action] = Action.LOWRANK
    rank: int  # of the factors of the (rows, last dimension) matrix


@dataclass(frozen=True, kw_only=True)
class RebuildNormInput(Plan):
    """A norm's input rebuilt in backward from its output's stored form (Quantize's codes or LowRank's factors)."""

    action: ClassVar[Action] = Action.PRENORM
    bits: int | None = None  # the output's codes (None: its factors)
    rank: int = 0  # the output's factors' rank
    exact_channels: int = 0  # input channels (smallest |gamma|) saved exactly
    norm: NormUnit | None = field(default=None, compare=False)  # whose output rebuilds the input
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        _set_source(self, self.norm.output if self.norm is not None else None)


@dataclass(frozen=True, kw_only=True)
class Checkpoint(Plan):
    """Inside a block memory_budget checkpoints: recomputed with the block in backward."""

    action: ClassVar[Action] = Action.CHECKPOINT
    block: str  # the block's name (analysis.blocks.Block.name)
    price: str = ""  # the block's checkpoint, as the report tells it ('' on the plans it is priced with)
