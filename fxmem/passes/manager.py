"""Runs named graph passes in order, stage by stage, and records what each did.

Three stages: "dynamo" passes rewrite the torch-level graph dynamo captured,
before AOTAutograd traces it; "joint" passes rewrite the joint forward+backward
graph before torch's min-cut partition; "partitioned" passes rewrite the forward
and backward graphs after it, with the saved-tensor analysis and plan in hand. A pass that
raises is recorded and its whole stage is rolled back, so the region compiles
as inductor would have compiled it: a bug in a pass never breaks a training run.
"""

from __future__ import annotations

import copy
import operator
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from fxmem.analysis import Analysis
from fxmem.analysis.meta import MODULE_STACK, RECOMPUTE
from fxmem.config import Config
from fxmem.cost_model.plan import Action, Keep, Plan
from fxmem.fallback import FallbackError, fall_back
from fxmem.kernels import calibration
from fxmem.kernels import probe as probe_kernel
from fxmem.kernels.calibration import QuantSlot

Stage = Literal["dynamo", "joint", "partitioned"]
STAGES: tuple[Stage, ...] = ("dynamo", "joint", "partitioned")


@dataclass
class PipelineState:
    """What passes read and rewrite for one compiled region."""

    config: Config
    joint: GraphModule | None = None
    joint_inputs: Sequence[Any] = ()
    dynamo: GraphModule | None = None  # the "dynamo" stage's graph
    num_fwd_outputs: int = 0  # the forward's user outputs; saved tensors follow them
    fw: GraphModule | None = None
    bw: GraphModule | None = None
    analysis: Analysis | None = None
    plans: list[Plan] = field(default_factory=list)
    slots: list[QuantSlot] = field(default_factory=list)  # runtime state the rewritten graphs use
    # backward node restoring a quantized storage -> (packed codes, scale, zero, QuantSpec) it reads (quantize)
    dequantized: dict[Node, tuple] = field(default_factory=dict)
    # forward node (by name) -> the forward nodes saved in its place (quantize, lowrank: saved_rewrite.compress_storage)
    stored: dict[str, list[Node]] = field(default_factory=dict)
    # fidelity probes (fxmem.kernels.probe) inserted, as (probe id, saved tensor name); None: insert none
    probes: list[tuple[int, str]] | None = None
    # recompute_attention: the layers (analysis.graph.layer_of) whose attention it recomputes; None: every layer
    attention_layers: frozenset[str] | None = None
    # checkpoint_blocks: the blocks (analysis.blocks.Block.name) it checkpoints; None: every block
    blocks: frozenset[str] | None = None

    def graphs(self, stage: Stage) -> dict[str, GraphModule]:
        if stage == "dynamo":
            return {"dynamo": self.dynamo}
        return {"joint": self.joint} if stage == "joint" else {"fw": self.fw, "bw": self.bw}


@dataclass(frozen=True)
class PassResult:
    """What one pass did to a region's graphs."""

    changed: bool  # it rewrote a graph: the region is no longer what inductor alone would compile
    note: str = ""  # what it changed, or why it left the graphs as torch runs them ('' where there is nothing to say)
    redraws: bool = False  # backward draws again random numbers forward drew (a replayed dropout, a recomputed block)


def pass_result(changed: bool, *notes: str, redraws: bool = False) -> PassResult:
    """A result whose note is the non-empty ``notes`` joined."""
    return PassResult(changed, "; ".join(note for note in notes if note), redraws)


UNCHANGED = PassResult(False)


@dataclass(frozen=True)
class PassRecord:
    name: str
    stage: Stage
    result: PassResult
    seconds: float
    error: str | None = None

    @property
    def changed(self) -> bool:
        return self.error is None and self.result.changed

    @property
    def note(self) -> str:
        return self.result.note

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "stage": self.stage, "changed": self.changed, "note": self.note,
                "seconds": round(self.seconds, 4), "error": self.error}


class GraphPass(ABC):
    """One rewrite. Subclasses set ``name`` and ``stage`` and implement ``run``."""

    name: ClassVar[str]
    stage: ClassVar[Stage]
    # Changes which kernel runs a product, not what is saved: fxmem.inspect (and whatif) leave it out.
    speed_only: ClassVar[bool] = False
    # The techniques it serves (fxmem.techniques sets them on fxmem's passes): it runs when one of them is
    # enabled; () always.
    techniques: tuple[Any, ...] = ()

    def enabled(self, config: Config) -> bool:
        return not self.techniques or any(technique.enabled(config) for technique in self.techniques)

    @abstractmethod
    def run(self, state: PipelineState) -> PassResult:
        """Rewrite ``state``'s graphs in place; say whether it changed them, and how or why not."""


def copy_graph_module(gm: GraphModule) -> GraphModule:
    # Graph.__deepcopy__ copies nodes with shallow-copied meta: cheap, and fake tensors are shared. Copying
    # its pytree codegen trips a deprecation inside torch that is not the user's concern.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        graph = copy.deepcopy(gm.graph)
    return GraphModule(gm, graph, gm.__class__.__name__)


def replace_with_call(graph: Graph, old: Node, function: Any, args: tuple) -> Node:
    """``function(*args)`` inserted before ``old`` in a dynamo graph, read by every reader of ``old`` instead. It
    keeps ``old``'s module stack: the op stays in its block for what reads module paths (checkpoint_blocks, the
    reports)."""
    with graph.inserting_before(old):
        new = graph.call_function(function, args)
    new.meta[MODULE_STACK] = dict(old.meta.get(MODULE_STACK, {}))
    old.replace_all_uses_with(new)
    return new


def eliminate_dead_code(graph: Graph) -> None:
    """fx's dead-code elimination, for a graph dynamo captured: a call of an in-place tensor method or function
    (``k[..., :r].copy_(x)``, ``mask.scatter_(...)``, named with a trailing underscore) is kept, though nothing
    reads its result; fx's own test knows aten's schemas, not these calls, and drops them."""
    graph.eliminate_dead_code(is_impure_node=lambda node: node.is_impure() or _in_place_call(node))


def _in_place_call(node: Node) -> bool:
    if node.op == "call_method":
        name = node.target
    elif node.op == "call_function" and getattr(operator, str(getattr(node.target, "__name__", "")), None) is None:
        name = node.target.__name__  # a torch function (operator's and_, or_ are not in place)
    else:
        return False
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def joint_primals(graph: Graph) -> frozenset[Node]:
    """The joint graph's forward inputs (parameters, buffers and user inputs): AOTAutograd names them primals_*."""
    return frozenset(n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals"))


def tag_must_recompute(nodes: Iterable[Node]) -> None:
    """Make torch's min-cut partitioner recompute these joint-graph nodes in backward instead of saving them. An
    output of a multi-output op (a getitem of split_with_sizes) takes its op along: the partitioner can neither
    save a tuple nor recompute the op untagged, and fails to partition."""
    for node in nodes:
        node.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
        parent = node.args[0] if node.target is operator.getitem and node.args else None
        if isinstance(parent, Node) and isinstance(parent.meta.get("val"), (tuple, list)):
            parent.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE


class PassManager:
    def __init__(self, passes: Sequence[GraphPass] = ()) -> None:
        for p in passes:
            if p.stage not in STAGES:
                raise ValueError(f"pass {p.name!r} has stage {p.stage!r}; valid stages: {', '.join(STAGES)}")
        self.passes = list(passes)

    def run(self, stage: Stage, state: PipelineState, skip: Mapping[str, str] | None = None) -> list[PassRecord]:
        """Run the stage's enabled passes in order; ``skip``: passes left out, each recorded with its reason."""
        skip = skip or {}
        enabled = [p for p in self.passes if p.stage == stage and p.enabled(state.config)]
        skipped = [PassRecord(p.name, stage, PassResult(False, skip[p.name]), 0.0) for p in enabled if p.name in skip]
        active = [p for p in enabled if p.name not in skip]
        if not active:
            return skipped
        snapshot = {key: copy_graph_module(gm) for key, gm in state.graphs(stage).items()}
        plans, slots = list(state.plans), list(state.slots)
        dequantized, stored = dict(state.dequantized), dict(state.stored)
        probes = None if state.probes is None else list(state.probes)
        records: list[PassRecord] = []
        for position, graph_pass in enumerate(active):
            start = time.perf_counter()
            try:
                result = graph_pass.run(state)
                if not isinstance(result, PassResult):
                    raise TypeError(f"pass {graph_pass.name} returned {type(result).__name__}, not a PassResult")
                for gm in state.graphs(stage).values():
                    gm.graph.lint()
                    gm.recompile()
            except FallbackError:  # strict mode, raised by the pass itself
                raise
            except Exception as error:  # roll the stage back: the region compiles as if fxmem did nothing here
                for key, gm in snapshot.items():
                    setattr(state, key, gm)
                if state.probes is not None:  # the stage's probes are gone with its graphs: free their switches
                    kept = {probe for probe, _ in probes or ()}
                    probe_kernel.release([probe for probe, _ in state.probes if probe not in kept])
                kept_slots = {slot.id for slot in slots}  # and its calibration slots
                calibration.release(slot for slot in state.slots if slot.id not in kept_slots)
                state.slots, state.dequantized, state.stored, state.probes = slots, dequantized, stored, probes
                # what the stage would have moved to host memory (block_offload) stays on the device too
                state.plans = [p if p.action is Action.KEEP and not p.host
                               else Keep(f"pass {graph_pass.name} failed: rolled back") for p in plans]
                # the stage's earlier passes are undone with it: they changed nothing that stays
                records = [replace(r, result=PassResult(False, r.note)) for r in records]
                records.append(PassRecord(graph_pass.name, stage, UNCHANGED, time.perf_counter() - start,
                                          error=f"{type(error).__name__}: {error}"))
                records.extend(PassRecord(p.name, stage, PassResult(False, "not run: an earlier pass of this stage "
                                                                           "failed"), 0.0)
                               for p in active[position + 1:])
                # strict mode raises here, the pass's own error chained; otherwise the region warns (Region.add)
                fall_back(f"pass {graph_pass.name} ({stage} stage) failed: {type(error).__name__}: {error}",
                          state.config, warn=False)
                return records + skipped
            records.append(PassRecord(graph_pass.name, stage, result, time.perf_counter() - start))
        return records + skipped
