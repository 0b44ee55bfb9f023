"""The torch.compile backend: inductor's own pipeline with fxmem at the partition step.

Inductor runs as usual (pre-grad passes, AOTAutograd with its decompositions,
joint-graph passes, lowering) on the graph dynamo captured, once fxmem's
"dynamo" passes have rewritten it (the chunked loss); fxmem replaces only the
partitioner, through inductor's ``custom_partitioner_fn`` hook, with: joint
rewrites -> torch's min-cut partition -> saved-tensor analysis -> plan ->
forward/backward rewrites.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import linecache
import pathlib
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from functorch.compile import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch.fx import GraphModule
from torch.fx.graph_module import _loader as fx_source_loader

from fxmem.analysis import Analysis, SavedTensor, analyze
from fxmem.analysis.blocks import find_blocks
from fxmem.analysis.liveness import compiled_liveness, graph_liveness
from fxmem.analysis.pinned import Pinned, pinned
from fxmem.config import Config
from fxmem.cost_model.auto import choose_auto, predicted_peak_bytes
from fxmem.cost_model.memory import op_workspace_bytes
from fxmem.cost_model.plan import Plan
from fxmem.cost_model.planner import BLOCK_CHECKPOINT_REASON, budget_bytes, budget_note, plan_region, replay_sources
from fxmem.fallback import fall_back, strict, unsupported
from fxmem.kernels import calibration
from fxmem.kernels import probe as probe_kernel
from fxmem.measure import format_bytes
from fxmem.passes import PassManager, PassRecord, PipelineState
from fxmem.passes.manager import copy_graph_module, tag_must_recompute
from fxmem.passes.replay_dropout import SEEDED_DRAW
from fxmem.peft_lora import prepare_peft
from fxmem.region import Region
from fxmem.report import Report
from fxmem.techniques import default_passes, enabled_techniques

if TYPE_CHECKING:
    from fxmem.guard import GuardCheck

Lowering = Literal["inductor", "eager"]
LOWERINGS = ("inductor", "eager")


# Attention is recomputed in backward only so that its saved output agrees with compressed q, k and v
# (passes/recompute_attention.py). A memory_budget plan is made first without it, and kept when q, k and v stay
# exact; else it runs in the layers whose q, k or v that plan compressed, and the others keep theirs exact: an
# attention forward per layer in backward is spent only where the budget needs those bytes. Block checkpoints
# likewise: that first plan weighs each block's checkpoint among its options, and the region is partitioned again
# with the blocks it chose checkpointed.
_NO_BLOCK_CHECKPOINT = {"checkpoint_blocks": "not run: memory_budget's plan checkpoints no block"}
_DEFERRED_UNDER_BUDGET = {"recompute_attention": "not run: q, k and v stay exact under memory_budget",
                          **_NO_BLOCK_CHECKPOINT}


@dataclasses.dataclass
class _Partition:
    """One way of partitioning and planning a region: the graphs, what the planner chose, and the records."""

    state: PipelineState  # its fw and bw: the partitioned graphs
    records: list[PassRecord]
    recomputed: list[tuple[SavedTensor, Plan]] = dataclasses.field(default_factory=list)
    failure: str | None = None  # the analysis or planning failed: the graphs are min-cut's, unplanned
    demoted: dict[str, int] = dataclasses.field(default_factory=dict)  # the guard's demotions its plans applied

    def checkpointed_blocks(self) -> dict[str, str]:
        """The blocks the plan checkpoints (memory_budget's first plan), each with its name and price."""
        return {saved.layer: plan.reason.removeprefix(BLOCK_CHECKPOINT_REASON).removesuffix(" (memory_budget)")
                for saved, plan in zip(self.state.analysis.saved, self.state.plans, strict=True)
                if plan.reason.startswith(BLOCK_CHECKPOINT_REASON)}

    def compressed_attention_layers(self) -> frozenset[str]:
        """The layers (analysis.graph.layer_of) whose attention q, k or v the plan stores lossily."""
        return frozenset(saved.layer for saved, plan in zip(self.state.analysis.saved, self.state.plans, strict=True)
                         if saved.feeds_attention is not None
                         and plan.action not in ("keep", "recompute", "checkpoint"))

    def keep_attention_inputs_outside(self, layers: frozenset[str]) -> None:
        """Attention's q, k and v kept exact in the layers whose attention is not recomputed: backward reads them
        beside its exact saved output, and the two must agree (passes/recompute_attention.py)."""
        keep = Plan("keep", "attention's input in a layer whose attention is not recomputed (memory_budget): "
                            "kept exact beside its saved output")
        saved_plans = list(zip(self.state.analysis.saved, self.state.plans, strict=True))
        # whole storages: the planner plans a storage once, for every saved view of it
        storages = {saved.storage for saved, plan in saved_plans if saved.feeds_attention is not None
                    and saved.layer not in layers and plan.action not in ("keep", "recompute")}
        self.state.plans = [keep if saved.storage in storages and plan.action != "recompute" else plan
                            for saved, plan in saved_plans]


class _Partitioner(CustomPartitionerFn):
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
        region.plans += [plan.record() for plan in state.plans + [plan for _, plan in chosen.recomputed]]
        region.slots += state.slots
        region.probes += state.probes or []
        return state.fw, state.bw

    def _budgeted(self, joint: GraphModule, joint_inputs: Sequence[Any], kwargs: dict[str, Any],
                  exact_bytes: int | None) -> _Partition:
        """memory_budget's partition: planned first without recompute_attention and checkpoint_blocks (each block's
        checkpoint then one of the plan's options), then, where that plan compressed a layer's q, k or v or
        checkpointed blocks, partitioned and planned again with attention recomputed in those layers alone (outside
        the blocks) and those blocks checkpointed."""
        region, config = self.region, self.region.config
        first = self._partition(copy_graph_module(joint), joint_inputs, kwargs, exact_bytes,
                                deferred=_DEFERRED_UNDER_BUDGET, offer_blocks=config.block_checkpoint)
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
        blocks = first.checkpointed_blocks()
        layers = first.compressed_attention_layers()
        if not blocks and not layers:
            return first
        if blocks:
            region.notes.append("memory_budget checkpoints " + "; ".join(sorted(blocks.values())))
        chosen = self._partition(joint, joint_inputs, kwargs, exact_bytes, attention_layers=layers,
                                 deferred=None if blocks else _NO_BLOCK_CHECKPOINT, blocks=frozenset(blocks) or None)
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
                   offer_blocks: bool = False) -> _Partition:
        """The joint passes but ``deferred`` (recompute_attention in ``attention_layers`` only, checkpoint_blocks in
        ``blocks`` only, where given), torch's min-cut, the analysis and the plan (with a second min-cut for the
        planner's recomputations). With ``offer_blocks`` the plan may checkpoint blocks: it is then returned as it
        is, to be partitioned again with them."""
        config = self.region.config
        state = PipelineState(config=config, joint=joint, joint_inputs=joint_inputs,
                              num_fwd_outputs=kwargs["num_fwd_outputs"], probes=[] if self.fidelity_probes else None,
                              attention_layers=attention_layers, blocks=blocks)
        records = self.passes.run("joint", state, skip=deferred)
        offered = tuple(find_blocks(state.joint.graph)) if offer_blocks else ()
        # min-cut marks the graph it partitions: a copy to partition again with the planner's recomputations
        joint_for_recompute = copy_graph_module(state.joint) if config.compresses else None
        state.fw, state.bw = min_cut_rematerialization_partition(state.joint, joint_inputs, **kwargs)
        try:
            state.analysis = dataclasses.replace(self._analyze(state.fw, state.bw, kwargs, exact_bytes),
                                                 blocks=offered)
            state.plans = plan_region(state.analysis, config, enabled_techniques(config), self.demotions)
            demoted = {s.key: self.demotions[s.key] for s in state.analysis.saved if s.key in self.demotions}
            recomputed = [(s, p) for s, p in zip(state.analysis.saved, state.plans, strict=True)
                          if p.action == "recompute"]
            # partition again, those tensors' chains tagged, and plan what is saved then (not where blocks are
            # checkpointed: the backend partitions again with them)
            if recomputed and not any(p.action == "checkpoint" for p in state.plans):
                names = {node.name for _, plan in recomputed for node in plan.chain}
                tag_must_recompute(n for n in joint_for_recompute.graph.nodes if n.name in names)
                state.fw, state.bw = min_cut_rematerialization_partition(joint_for_recompute, joint_inputs, **kwargs)
                sources = replay_sources(recomputed)
                analysis = self._analyze(state.fw, state.bw, kwargs, exact_bytes, recompute=False)
                state.analysis = dataclasses.replace(analysis, rebuild_sources=analysis.rebuild_sources | sources)
                state.plans = plan_region(state.analysis, config, enabled_techniques(config), self.demotions)
        except Exception as error:  # reported, and the region compiles as plain inductor
            return _Partition(state, records, failure=f"{type(error).__name__}: {error}")
        return _Partition(state, records, recomputed, demoted=demoted)

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
    def __deepcopy__(self, memo: dict) -> _Partitioner:
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


def run_eagerly(gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
    """Lowering for inspection: run the partitioned aten graphs as they are, no code generation; inductor's seeded
    draws drawn from their seeds, so that a forward and a backward that both draw one mask (replay_dropout) agree."""
    draws = [n for n in gm.graph.nodes if n.target is SEEDED_DRAW]
    for node in draws:
        node.target = _seeded_draw
    if draws:
        gm.recompile()
    return make_boxed_func(gm.forward)


def _seeded_draw(size: Sequence[int], seed: torch.Tensor, mode: str, *, align_dtype: Any = None) -> torch.Tensor:
    """``prims.inductor_random`` as inductor lowers it, a function of its seed (its eager form ignores the seed: a
    replayed draw would differ from the first)."""
    generator = torch.Generator(device=seed.device).manual_seed(int(seed))
    return getattr(torch, mode)(size, generator=generator, device=seed.device, dtype=torch.float32)


_RANDOM_OPS = (torch.ops.aten.rand_like.default, torch.ops.aten.rand.default)


def _lower_random_ops(gm: GraphModule) -> None:
    """Inductor lowers random ops only as its joint-graph pass rewrites them (to its seeded prims), and that pass
    ran before fxmem's passes: stochastic rounding's random numbers are rewritten here."""
    if any(node.target in _RANDOM_OPS for node in gm.graph.nodes):
        from torch._inductor.fx_passes.replace_random import replace_random_passes
        replace_random_passes(gm)
        gm.recompile()


def _draws_again(record: PassRecord) -> bool:
    """A pass that has backward draw again dropout masks forward drew: replayed, or in a checkpointed block."""
    return bool(record.summary) and (record.name == "replay_dropout" or (
        record.name == "checkpoint_blocks" and "checkpointed from their outputs" in record.summary))


def _lower_or_run_as_is(region: Region) -> Callable:
    """Inductor's lowering; a graph fxmem rewrote that inductor cannot lower runs as aten ops, with a note.

    Backward graphs are compiled lazily, at the first backward: this is where such a failure surfaces, after
    the forward is already compiled against the rewritten backward, so the rewrite itself must stay.
    """
    def compile_inner(gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
        try:
            _lower_random_ops(gm)
            return compile_fx_inner(gm, example_inputs, **kwargs)
        except Exception as error:
            if not any(p.summary for p in region.passes):
                raise  # fxmem changed nothing: torch's own error, as it would be without fxmem
            if any(n.target is SEEDED_DRAW for n in gm.graph.nodes) and any(map(_draws_again, region.passes)):
                # its other graph draws the same masks in inductor's code: eagerly they would differ
                raise RuntimeError(f"fxmem region {region.index}: inductor could not lower a graph that draws the "
                                   "dropout masks backward draws again (replay_dropout, checkpoint_blocks), and run "
                                   "eagerly it would draw other masks than its compiled counterpart "
                                   f"({type(error).__name__})") from error
            message = str(error).splitlines()[0] if str(error) else ""
            note = (f"inductor could not lower a rewritten graph ({type(error).__name__}: {message}); "
                    "it runs as aten ops, unfused")
            fall_back(f"fxmem region {region.index}: {note}", region.config)
            region.notes.append(note)
            return run_eagerly(gm, example_inputs)
    return compile_inner


def _fx_sources() -> set[str]:
    """The names of the generated sources torch.fx keeps, for tracebacks, of every GraphModule it ever compiled.
    torch never frees them, and fxmem's passes and partition recompile many graphs a region where torch.compile
    alone makes two, so they would add up with every compile (measured: docs/recipes.md)."""
    return set(fx_source_loader.eval_cache)


def _forget_fx_sources(names: set[str]) -> None:
    for name in names:
        fx_source_loader.eval_cache.pop(name, None)
        linecache.cache.pop(name, None)


class _CompiledGraphs:
    """A region's compiled graphs (forward, backward, inference) still alive; the last one freed calls ``release``
    with the generated sources of the graphs the region's compile made.

    What inductor's (or the eager) lowering returns for a graph is what AOTAutograd calls to run it, and it is
    freed with the code (``torch._dynamo.reset()``): the forward reads the calibration slots, the backward the
    fidelity probes. Not the callable the backend returns: dynamo unwraps that one, and frees it at once.
    """

    def __init__(self, release: Callable[[set[str]], None]) -> None:
        self.live = 0
        self.fx_sources: set[str] = set()
        self._release = release

    def compiling(self, inner_compile: Callable) -> Callable:
        def compile_graph(gm: GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Callable:
            before = _fx_sources()
            try:  # the backward is compiled lazily, after the backend returned
                compiled = inner_compile(gm, example_inputs, **kwargs)
            finally:
                self.fx_sources |= _fx_sources() - before
            self.live += 1
            weakref.finalize(compiled, self._freed)
            return compiled
        return compile_graph

    def _freed(self) -> None:
        self.live -= 1
        if not self.live:
            self._release(self.fx_sources)


class _Predicted(Exception):
    """Stops a compile once its region is partitioned and planned, before inductor lowers it."""


class Backend:
    """A torch.compile backend with its own configuration; ``regions`` holds one record per compiled graph, names
    and figures without the graphs.

    ``fidelity_probes``: also save every compressed tensor exactly, and read it back in backward through a switch
    between the two (fxmem.kernels.probe), so that ``fxmem.check_fidelity`` measures each one's error alone. A
    diagnostic: it saves more than no compression at all.

    A region's calibration slots and fidelity probes are released when its compiled code is freed (a dropped model,
    ``torch._dynamo.reset()``); its record stays in ``regions`` for the report, unless ``keep_dropped_regions`` is
    False: then it leaves with its code (``backend="fxmem"``, whose report no one holds).

    Each region turns its options set to "auto" on or off (cost_model.auto.choose_auto)."""

    def __init__(self, config: Config | None = None, *, lowering: Lowering = "inductor",
                 passes: PassManager | None = None, fidelity_probes: bool = False,
                 keep_dropped_regions: bool = True, demotions: Mapping[str, int] | None = None) -> None:
        if lowering not in LOWERINGS:
            raise ValueError(f"lowering must be one of {', '.join(LOWERINGS)}; got {lowering!r}")
        self.config = config or Config()
        strict(self.config)  # a bad FXMEM_STRICT is refused here, not at the first fallback
        self.lowering = lowering
        self.passes = passes or PassManager(default_passes())
        self.fidelity_probes = fidelity_probes
        self.keep_dropped_regions = keep_dropped_regions
        # the guard's (fxmem/guard.py): a saved tensor's key -> steps its compression is made less lossy; read by the
        # regions compiled after it is set
        self.demotions: dict[str, int] = dict(demotions or {})
        self.regions: list[Region] = []
        self.guard_checks: list[GuardCheck] = []  # the guard's checks of this backend's plan (fxmem/guard.py)
        self._indices = itertools.count()  # region numbers stay unique as dropped regions leave

    def __call__(self, gm: GraphModule, example_inputs: Sequence[Any], *,
                 options: dict[str, Any] | None = None, mode: str | None = None) -> Callable:
        fxmem_options, inductor_options = _split_options(options)
        config = _config_with_options(self.config, fxmem_options)
        start = time.perf_counter()
        sources = _fx_sources()
        patches: dict[str, Any] = dict(LOWERING_PATCHES)
        if mode is not None:
            patches.update(torch._inductor.list_mode_options(mode))
        patches.update(inductor_options)
        auto_notes = []
        if config.auto_options():  # each group of them on or off, by the region's predicted peak
            choice = choose_auto(config, functools.partial(self._predicted_peak, gm, example_inputs, patches=patches))
            if choice.failure is not None:
                fall_back(f"fxmem: {choice.failure}", config)
            config, auto_notes = choice.config, choice.notes
        region = Region(index=next(self._indices), config=config, notes=auto_notes)
        self.regions.append(region)
        state = PipelineState(config=config, dynamo=gm)
        region.add_passes(self.passes.run("dynamo", state))
        gm = state.dynamo
        patches["custom_partitioner_fn"] = _Partitioner(region, self.passes, self.fidelity_probes, self.demotions)
        graphs = _CompiledGraphs(functools.partial(self._release, region))
        inner = graphs.compiling(_lower_or_run_as_is(region) if self.lowering == "inductor" else run_eagerly)
        try:
            # AOTAutograd's cache would skip the partitioner on a hit, and with it fxmem's analysis and rewrites.
            with torch._functorch.config.patch(enable_autograd_cache=False):
                compiled = compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
        except BaseException:
            self._release(region, _fx_sources() - sources)  # no code reads its slots and probes
            raise
        graphs.fx_sources |= _fx_sources() - sources
        region.compile_seconds = time.perf_counter() - start
        if region.kind == "compiling":
            region.kind = "inference"
        return compiled

    def _predicted_peak(self, gm: GraphModule, example_inputs: Sequence[Any], config: Config, *,
                        patches: dict[str, Any]) -> int | str | None:
        """The predicted peak of activations (cost_model.auto.predicted_peak_bytes) of the region traced,
        partitioned and planned under ``config`` (and its dynamo passes), stopped before inductor lowers it; None
        where it does not train (no partition), the error's text where it fails."""
        region = Region(index=-1, config=config)

        def stop(*args: Any, **kwargs: Any) -> Callable:
            raise _Predicted

        sources = _fx_sources()
        try:
            with warnings.catch_warnings():  # the chosen compile warns for itself
                warnings.simplefilter("ignore")
                state = PipelineState(config=config, dynamo=copy_graph_module(gm))
                region.add_passes(self.passes.run("dynamo", state))
                with torch._functorch.config.patch(enable_autograd_cache=False):
                    compile_fx(state.dynamo, example_inputs, inner_compile=stop, config_patches={
                        **patches, "custom_partitioner_fn": _Partitioner(region, self.passes,
                                                                         demotions=self.demotions)})
        except _Predicted:
            pass
        except Exception as error:  # noqa: BLE001 - the options stay off, and the report says why
            return f"{type(error).__name__}: {error}"
        finally:  # its graphs, and the calibration slots its quantize pass made, are never run
            self._release(region, _fx_sources() - sources)
        if region.kind != "training":
            return None
        if not region.compiled_liveness:  # not planned (_unplanned): nothing priced, which is no peak of 0 bytes
            return region.notes[-1] if region.notes else "the region was not planned"
        return predicted_peak_bytes(region.saved, region.plans, region.compiled_transient_bytes)

    def _release(self, region: Region, fx_sources: set[str]) -> None:
        """The region's code is gone: free the runtime state it read, and the sources of its graphs."""
        _forget_fx_sources(fx_sources)
        calibration.release(region.slots)
        probe_kernel.release([probe for probe, _ in region.probes])
        if not self.keep_dropped_regions:
            self.regions = [r for r in self.regions if r is not region]

    def report(self) -> Report:
        return Report(self.regions, self.guard_checks)


# Inductor options for fxmem's graphs (docs/long-context.md has the measurements); a user's own override them.
# - Reordering a graph for its estimated peak raised the measured peak of long steps, and lowered it on none.
# - A horizontal fusion (two kernels that read a common input, neither the other's output) saves reading that input
#   once. Inductor fuses any that share 10 bytes: in a backward that recomputes layers, one layer's RoPE recompute
#   fused with the next layer's RoPE backward (they share the rotary frequencies, 128 bytes) ran a layer early and
#   held its q and k buffers through that layer's MLP backward. Below 1 MiB a second read costs under a microsecond
#   of bandwidth on a GPU, besides the launch. On a GPU the same threshold also gates inductor's loop reordering
#   for fusion (skipped on a CPU): not measured there.
LOWERING_PATCHES: dict[str, Any] = {"reorder_for_peak_memory": False, "score_fusion_memory_threshold": 1 << 20}


def _split_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.compile``'s ``options``, split into fxmem's (Config fields and 'preset') and inductor's own
    (``torch._inductor.config`` names, e.g. "triton.cudagraphs"); a name that is neither is refused."""
    fxmem_names = {f.name for f in dataclasses.fields(Config)} | {"preset"}
    inductor_names = set(torch._inductor.config.get_config_copy()) - {"custom_partitioner_fn"}  # that one is fxmem
    fxmem_options, inductor_options = {}, {}
    for name, value in (options or {}).items():
        if name in fxmem_names:
            fxmem_options[name] = value
        elif name in inductor_names:
            inductor_options[name] = value
        else:
            raise ValueError(f"unknown option {name!r}: neither an fxmem option ({', '.join(sorted(fxmem_names))}) "
                             "nor an inductor config name (torch._inductor.config, e.g. 'triton.cudagraphs')")
    return fxmem_options, inductor_options


def _config_with_options(config: Config, options: dict[str, Any]) -> Config:
    if not options:
        return config
    options = dict(options)
    preset = options.pop("preset", None)
    return Config.from_preset(preset, **options) if preset is not None else config.replace(**options)


def backend(preset: str = "exact", **overrides: Any) -> Backend:
    """A backend for ``torch.compile(model, backend=fxmem.backend(preset=..., **overrides))``."""
    return Backend(Config.from_preset(preset, **overrides))


def compile_(model: torch.nn.Module, preset: str = "exact", **overrides: Any) -> Backend:
    """Compile ``model`` in place with fxmem (``nn.Module.compile``) and return the backend, whose ``report()``
    says what it saved. The model keeps its class, attributes and ``forward``'s signature, so HF's Trainer and
    TRL's trainers keep the batch columns ``forward`` names (``torch.compile(model)`` returns a wrapper whose
    signature is ``*args, **kwargs``: Trainer then drops every column). PEFT's LoRA on routers and experts is
    prepared first (``fxmem.prepare_peft``). With ``Config.guard`` (the lossy presets) the plan is checked on the
    training batches and mended (fxmem/guard.py)."""
    compiled = backend(preset, **overrides)
    prepare_peft(model, compiled.config)
    model.compile(backend=compiled)
    if compiled.config.guard and compiled.config.compresses:
        from fxmem.guard import guard  # it imports this module

        guard(model, compiled)
    return compiled


# Its regions leave with their compiled code: a process that compiles and drops models does not grow.
_DEFAULT = Backend(keep_dropped_regions=False)


def fxmem_backend(gm: GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                  mode: str | None = None) -> Callable:
    """What ``torch.compile(model, backend="fxmem")`` calls (registered by entry point, never at import)."""
    return _DEFAULT(gm, example_inputs, options=options, mode=mode)
