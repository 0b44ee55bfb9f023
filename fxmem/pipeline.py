"""One region's partition step, fxmem's pipeline between AOTAutograd and inductor's lowering (Backend installs
``Partitioner`` as inductor's ``custom_partitioner_fn``): the joint passes, torch's min-cut, the saved-tensor
analysis and the plan, min-cut again for the planner's recomputations, then the partitioned passes.

Min-cut runs at most twice per region for a preset: once on the joint graph, once more with the plan's
recomputations tagged (the plan reads what min-cut saves, and what min-cut saves follows from what the plan
recomputes). Under memory_budget at most three times: a fraction is of torch's own partition (one min-cut,
unplanned: fxmem's joint passes change what is saved, so no other partition measures it); the first plan's; then
either its recomputations tagged, or, where it compresses q, k or v or checkpoints blocks, the region partitioned
again with attention recomputed in those layers and those blocks checkpointed, the first plan's recomputations
tagged before that one min-cut and none offered again (tests/test_pipeline.py counts them). One more where the
first plan's own re-plan compresses q, k or v (attention must then be recomputed beside them), where a carried
chain cannot be tagged (its nodes not all in the second joint graph, or one a joint pass must save), or where the
first plan fails.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.fx import GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

from fxmem.analysis import Analysis, SavedTensor, analyze
from fxmem.analysis.blocks import Block, find_blocks
from fxmem.analysis.liveness import compiled_liveness, graph_liveness
from fxmem.analysis.meta import RECOMPUTE
from fxmem.analysis.pinned import Pinned, pinned
from fxmem.cost_model.budget import budget_bytes, budget_note
from fxmem.cost_model.memory import op_workspace_bytes
from fxmem.cost_model.plan import Action, Checkpoint, Keep, Plan
from fxmem.cost_model.planner import plan_region, replay_sources
from fxmem.fallback import fall_back, unsupported
from fxmem.measure import format_bytes
from fxmem.passes import PassManager, PassRecord, PipelineState
from fxmem.passes.manager import copy_graph_module, tag_must_recompute
from fxmem.region import Region
from fxmem.techniques import enabled_techniques

# Attention is recomputed in backward only so that its saved output agrees with compressed q, k and v
# (passes/joint/recompute_attention.py). A memory_budget plan is made first without it, and kept when q, k and v stay
# exact; else it runs in the layers whose q, k or v that plan compressed, and the others keep theirs exact: an
# attention forward per layer in backward is spent only where the budget needs those bytes. Block checkpoints
# likewise: that first plan weighs each block's checkpoint among its options, and the region is partitioned again
# with the blocks it chose checkpointed.
_NO_BLOCK_CHECKPOINT = {"checkpoint_blocks": "not run: memory_budget's plan checkpoints no block"}
_DEFERRED_UNDER_BUDGET = {"recompute_attention": "not run: q, k and v stay exact under memory_budget",
                          **_NO_BLOCK_CHECKPOINT}


@dataclasses.dataclass
class Partition:
    """One way of partitioning and planning a region: the graphs, what the planner chose, and the records."""

    state: PipelineState  # its fw and bw: the partitioned graphs
    records: list[PassRecord]
    recomputed: list[tuple[SavedTensor, Plan]] = dataclasses.field(default_factory=list)
    failure: str | None = None  # the analysis or planning failed: the graphs are min-cut's, unplanned
    demoted: dict[str, int] = dataclasses.field(default_factory=dict)  # the guard's demotions its plans applied

    def checkpointed_blocks(self) -> dict[str, str]:
        """The blocks the plan checkpoints (memory_budget's first plan), each with its name and price."""
        return {plan.block: f"{plan.block}: {plan.price}" for plan in self.state.plans
                if isinstance(plan, Checkpoint) and plan.price}

    def compressed_attention_layers(self) -> frozenset[str]:
        """The layers (analysis.graph.layer_of) whose attention q, k or v the plan stores lossily."""
        return frozenset(saved.layer for saved, plan in zip(self.state.analysis.saved, self.state.plans, strict=True)
                         if saved.feeds_attention is not None
                         and plan.action not in (Action.KEEP, Action.RECOMPUTE, Action.CHECKPOINT))

    def keep_attention_inputs_outside(self, layers: frozenset[str]) -> None:
        """Attention's q, k and v kept exact in the layers whose attention is not recomputed: backward reads them
        beside its exact saved output, and the two must agree (passes/joint/recompute_attention.py)."""
        keep = Keep("attention's input in a layer whose attention is not recomputed (memory_budget): "
                    "kept exact beside its saved output")
        saved_plans = list(zip(self.state.analysis.saved, self.state.plans, strict=True))
        # whole storages: the planner plans a storage once, for every saved view of it
        storages = {saved.storage for saved, plan in saved_plans if saved.feeds_attention is not None
                    and saved.layer not in layers and plan.action not in (Action.KEEP, Action.RECOMPUTE)}
        self.state.plans = [keep if saved.storage in storages and plan.action is not Action.RECOMPUTE else plan
                            for saved, plan in saved_plans]


class Partitioner(CustomPartitionerFn):
    def __init__(self, region: Region, passes: PassManager, fidelity_probes: bool = False,
                 demotions: Mapping[str, int] | None = None) -> None:
        # Weakly: inductor's config cache keeps the last partitioner alive after its compile, which must not keep
        # its region (the compile holds the region while it partitions).
        self._region = weakref.ref(region)
        self.config = region.config
        self.passes = passes
        self.fidelity_probes = fidelity_probes
        self.demotions = dict(demotions or {})

    @property
    def region(self) -> Region:
        region = self._region()
        assert region is not None, "a region partitions while its compile holds it"
        return region

    def __call__(self, joint: GraphModule, joint_inputs: Sequence[Any], **kwargs: Any
                 ) -> tuple[GraphModule, GraphModule]:
        region, config = self.region, self.region.config
        region.kind = "training"
        exact_bytes = None
        if config.memory_budget is not None and not config.budget_in_bytes():  # the budget's fraction is of this
            try:
                exact_fw, exact_bw = min_cut_rematerialization_partition(copy_graph_module(joint), joint_inputs,
                                                                         **kwargs)
                exact_bytes = sum(s.nbytes for s in self._analyze(exact_fw, exact_bw, kwargs).saved)
            except Exception as error:
                return self._unplanned(f"{type(error).__name__}: {error}",
                                       *min_cut_rematerialization_partition(joint, joint_inputs, **kwargs))
        if config.memory_budget is None:
            chosen = self._partition(joint, joint_inputs, kwargs, exact_bytes)
        else:
            chosen = self._budgeted(joint, joint_inputs, kwargs, exact_bytes)
        region.add_passes(chosen.records)
        state = chosen.state
        if chosen.failure is not None:
            return self._unplanned(chosen.failure, state.fw, state.bw)
        budget = budget_note(state.analysis, state.plans, config)
        if config.memory_budget is not None:
            region.budget_bytes = (region.budget_bytes or 0) + budget_bytes(state.analysis, config)
        if budget is not None:
            note, met = budget
            region.notes.append(note)
            if not met:
                warnings.warn(f"fxmem region {region.index}: {note}", stacklevel=2)
        region.notes += pinned_notes(pinned(state.analysis, state.fw.graph, kwargs["num_fwd_outputs"], joint.graph))
        recomputed = [plan for _, plan in chosen.recomputed]  # left to the re-partition: no pass rewrites them
        planned = state.plans + recomputed  # a copy: the passes replace items of state.plans
        region.add_passes(self.passes.run("partitioned", state))
        region.liveness.append((graph_liveness(state.fw.graph, op_workspace_bytes),
                                graph_liveness(state.bw.graph, op_workspace_bytes)))
        try:
            region.compiled_liveness.append(compiled_liveness(state.fw.graph, state.bw.graph,
                                                              state.num_fwd_outputs, op_workspace_bytes))
        except RuntimeError as error:  # a figure for reports: the region compiles without it
            region.notes.append(f"transients as inductor runs the graphs not counted: {error}")
            region.compiled_liveness.append(region.liveness[-1])
        # Appended: inductor may partition nested subgraphs of the region through this same hook. Records: the
        # region outlives the graphs, which it must not keep alive.
        region.demoted.update(chosen.demoted)
        region.saved += [saved.record() for saved in state.analysis.saved + [saved for saved, _ in chosen.recomputed]]
        region.plans += [plan.record() for plan in state.plans + recomputed]
        region.planned += [plan.record() for plan in planned]
        region.slots += state.slots
        region.probes += state.probes or []
        return state.fw, state.bw

    def _budgeted(self, joint: GraphModule, joint_inputs: Sequence[Any], kwargs: dict[str, Any],
                  exact_bytes: int | None) -> Partition:
        """memory_budget's partition: planned first without recompute_attention and checkpoint_blocks (each block's
        checkpoint then one of the plan's options), then, where that plan compressed a layer's q, k or v or
        checkpointed blocks, partitioned and planned again with attention recomputed in those layers alone (outside
        the blocks) and those blocks checkpointed."""
        region, config = self.region, self.region.config
        first = self._partition(copy_graph_module(joint), joint_inputs, kwargs, exact_bytes,
                                deferred=_DEFERRED_UNDER_BUDGET, offer_blocks=config.block_checkpoint,
                                may_partition_again=True)
        if first.failure is not None:
            note = (f"memory_budget's first plan failed ({first.failure}); the region is planned again with every "
                    "enabled pass run")
            fall_back(f"fxmem region {region.index}: {note}", config)
            region.notes.append(note)
            return self._partition(joint, joint_inputs, kwargs, exact_bytes)
        left = [b.name for b in first.state.analysis.blocks if b.random is not None]
        if left:
            note = (f"block_checkpoint: {len(left)} block(s) not among memory_budget's options: they draw random "
                    f"numbers ({', '.join(left)})")
            unsupported(f"fxmem region {region.index}: {note}", config)
            region.notes.append(note)
        if not _partitioned_again(first):
            return first
        blocks = first.checkpointed_blocks()
        layers = first.compressed_attention_layers()
        if blocks:
            region.notes.append("memory_budget checkpoints " + "; ".join(sorted(blocks.values())))
        chosen = self._partition(joint, joint_inputs, kwargs, exact_bytes, attention_layers=layers,
                                 deferred=None if blocks else _NO_BLOCK_CHECKPOINT, blocks=frozenset(blocks) or None,
                                 carried=first.recomputed)
        if chosen.failure is None:
            chosen.keep_attention_inputs_outside(layers)
        return chosen

    def _unplanned(self, failure: str, fw: GraphModule, bw: GraphModule) -> tuple[GraphModule, GraphModule]:
        """An unforeseen graph in the analysis or the plan: the region compiles min-cut's partition as inductor
        would, and the report and a warning say why."""
        note = f"saved-tensor analysis or planning failed ({failure}); this region compiles as plain inductor"
        fall_back(f"fxmem region {self.region.index}: {note}", self.region.config, stacklevel=3)
        self.region.notes.append(note)
        return fw, bw

    def _partition(self, joint: GraphModule, joint_inputs: Sequence[Any], kwargs: dict[str, Any],
                   exact_bytes: int | None, deferred: Mapping[str, str] | None = None,
                   attention_layers: frozenset[str] | None = None, blocks: frozenset[str] | None = None,
                   offer_blocks: bool = False, may_partition_again: bool = False,
                   carried: list[tuple[SavedTensor, Plan]] | None = None) -> Partition:
        """The joint passes but ``deferred`` (recompute_attention in ``attention_layers`` only, checkpoint_blocks in
        ``blocks`` only, where given), torch's min-cut, the analysis and the plan (with a second min-cut for the
        planner's recomputations). With ``offer_blocks`` the plan may checkpoint blocks. With
        ``may_partition_again`` (memory_budget's first plan), a plan the caller partitions again
        (_partitioned_again) is returned as it is: a second min-cut for its recomputations would be thrown away.
        ``carried``: that earlier plan's recomputations, tagged before the one min-cut here and not offered again."""
        config = self.region.config
        state = PipelineState(config=config, joint=joint, joint_inputs=joint_inputs,
                              num_fwd_outputs=kwargs["num_fwd_outputs"], probes=[] if self.fidelity_probes else None,
                              attention_layers=attention_layers, blocks=blocks)
        records = self.passes.run("joint", state, skip=deferred)
        offered = tuple(find_blocks(state.joint.graph)) if offer_blocks else ()
        tagged = self._tag_carried(state.joint, carried) if carried is not None else None
        # min-cut marks the graph it partitions: a copy to partition again with the planner's recomputations
        joint_for_recompute = copy_graph_module(state.joint) if config.compresses and tagged is None else None
        state.fw, state.bw = min_cut_rematerialization_partition(state.joint, joint_inputs, **kwargs)
        try:
            if tagged is None:
                state.analysis = dataclasses.replace(self._analyze(state.fw, state.bw, kwargs, exact_bytes),
                                                     blocks=offered)
                state.plans = plan_region(state.analysis, config, enabled_techniques(config), self.demotions)
            else:
                self._plan_recomputed(state, kwargs, exact_bytes, tagged, blocks=offered)
            demoted = {s.key: self.demotions[s.key] for s in state.analysis.saved if s.key in self.demotions}
            if tagged is not None:
                return Partition(state, records, tagged, demoted=demoted)
            recomputed = [(s, p) for s, p in zip(state.analysis.saved, state.plans, strict=True)
                          if p.action is Action.RECOMPUTE]
            # partition again, those tensors' chains tagged, and plan what is saved then
            if recomputed and not (may_partition_again and _partitioned_again(Partition(state, records))):
                tag_must_recompute(_chain_nodes(joint_for_recompute, recomputed))
                state.fw, state.bw = min_cut_rematerialization_partition(joint_for_recompute, joint_inputs, **kwargs)
                self._plan_recomputed(state, kwargs, exact_bytes, recomputed)
        except Exception as error:  # reported, and the region compiles as plain inductor
            return Partition(state, records, failure=f"{type(error).__name__}: {error}")
        return Partition(state, records, recomputed, demoted=demoted)

    @staticmethod
    def _tag_carried(joint: GraphModule, carried: list[tuple[SavedTensor, Plan]]
                     ) -> list[tuple[SavedTensor, Plan]] | None:
        """The first plan's recomputations tagged on ``joint`` before its one min-cut, where every node of their
        chains is in it and none is one a joint pass must save (else None: the plan offers recomputation again, and
        min-cut runs twice)."""
        nodes = _chain_nodes(joint, carried)
        # a chain through what a joint pass must save (checkpoint_blocks' block inputs, its tags the last word)
        if len(nodes) != len({n.name for _, plan in carried for n in plan.chain}) or any(
                n.meta.get(RECOMPUTE) is CheckpointPolicy.MUST_SAVE for n in nodes):
            return None
        tag_must_recompute(nodes)
        return carried

    def _plan_recomputed(self, state: PipelineState, kwargs: dict[str, Any], exact_bytes: int | None,
                         recomputed: list[tuple[SavedTensor, Plan]], blocks: tuple[Block, ...] = ()) -> None:
        """The analysis and plan of a partition with ``recomputed``'s chains tagged: none is offered recomputation
        again, and what they replay from is held as a rebuild source."""
        analysis = self._analyze(state.fw, state.bw, kwargs, exact_bytes, recompute=False)
        state.analysis = dataclasses.replace(analysis, blocks=blocks,
                                             rebuild_sources=analysis.rebuild_sources | replay_sources(recomputed))
        state.plans = plan_region(state.analysis, self.config, enabled_techniques(self.config), self.demotions)

    @staticmethod
    def _analyze(fw: GraphModule, bw: GraphModule, kwargs: dict[str, Any], exact_bytes: int | None = None, *,
                 recompute: bool = True) -> Analysis:
        """The saved tensors of a partition; ``recompute=False``: none offered for recomputation, element-wise or by
        a replayed matmul (the planner's recomputations are already in the partition)."""
        analysis = analyze(fw, bw, kwargs["num_fwd_outputs"], kwargs.get("static_lifetime_input_indices"))
        saved = analysis.saved if recompute else [dataclasses.replace(s, recompute=None, rebuild_product=None)
                                                  for s in analysis.saved]
        return dataclasses.replace(analysis, saved=saved, exact_bytes=exact_bytes)

    # Inductor deep-copies its config patches, and pickles them into its cache key. A copy would record into a
    # copy of the region, and both would copy the graphs the region's records point into (fake tensors refuse):
    # a copy is the partitioner itself, and its pickle is its uuid, which says all that decides the graphs.
    def __deepcopy__(self, memo: dict) -> Partitioner:
        return self

    def __reduce__(self) -> tuple:
        return str, (self.uuid(),)

    def uuid(self) -> str:
        # Enters inductor's cache key: fxmem's code and this region's config decide the graphs.
        return (f"{_source_hash()}:{self.config!r}:probes={self.fidelity_probes}:"
                f"demotions={sorted(self.demotions.items())}")


@functools.cache
def _source_hash() -> str:
    files = sorted(str(p) for p in pathlib.Path(__file__).parent.rglob("*.py"))
    return get_hash_for_files(tuple(files)).hex()


def _chain_nodes(joint: GraphModule, recomputed: list[tuple[SavedTensor, Plan]]) -> list[Node]:
    """The nodes of ``joint`` that the recomputations' chains name (planned on another copy of it)."""
    names = {node.name for _, plan in recomputed for node in plan.chain}
    return [n for n in joint.graph.nodes if n.name in names]


def _partitioned_again(first: Partition) -> bool:
    """Whether memory_budget's first plan is partitioned again (Partitioner._budgeted): it checkpoints blocks, or
    compresses q, k or v, whose attention is then recomputed."""
    return bool(first.checkpointed_blocks() or first.compressed_attention_layers())


def pinned_notes(held: Pinned) -> list[str]:
    """The report's lines on what the region holds that no plan can free."""
    notes = []
    if held.kv_cache_bytes:
        notes.append(f"the forward returns attention's k and v, {format_bytes(held.kv_cache_bytes)} the caller "
                     "holds: a KV cache (a model built with use_cache=True returns one); use_cache=False in training "
                     "frees it")
    if held.input_bytes:
        notes.append(f"{format_bytes(held.input_bytes)} of saved tensors are inputs the caller holds")
    if held.checkpointed_ops:
        notes.append(f"activation checkpointing (torch.utils.checkpoint, e.g. HF's gradient_checkpointing_enable) "
                     f"reruns {held.checkpointed_ops} forward ops of {held.checkpoint_regions} region(s) in "
                     "backward; fxmem plans only what crosses their boundaries. Without it fxmem's plan covers "
                     "the rest, without the rerun: compare fxmem.inspect with it off")
    return notes
