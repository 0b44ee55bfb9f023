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
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from functorch.compile import make_boxed_func
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.fx import GraphModule
from torch.fx.graph_module import _loader as fx_source_loader

from fxmem.config import Config
from fxmem.cost_model.auto import choose_auto, predicted_peak_bytes
from fxmem.cost_model.plan import Action
from fxmem.fallback import fall_back, strict
from fxmem.kernels import calibration
from fxmem.kernels import probe as probe_kernel
from fxmem.passes import PassManager, PipelineState
from fxmem.passes.joint.replay_dropout import SEEDED_DRAW
from fxmem.passes.manager import copy_graph_module
from fxmem.peft_lora import prepare_peft
from fxmem.pipeline import Partitioner
from fxmem.region import Region
from fxmem.report import Report
from fxmem.techniques import default_passes

if TYPE_CHECKING:
    from fxmem.guard import GuardCheck

Lowering = Literal["inductor", "eager"]
LOWERINGS = ("inductor", "eager")


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
            planned = any(p.action is not Action.KEEP or p.host for p in region.plans)  # the re-partition's too
            if not planned and not any(p.changed for p in region.passes):
                raise  # fxmem changed nothing: torch's own error, as it would be without fxmem
            redrawn = any(p.changed and p.result.redraws for p in region.passes)
            if redrawn and any(n.target is SEEDED_DRAW for n in gm.graph.nodes):
                # its other graph draws the same masks in inductor's code: eagerly they would differ
                raise RuntimeError(f"fxmem region {region.index}: inductor could not lower a graph that draws the "
                                   "dropout masks backward draws again (replay_dropout, checkpoint_blocks, "
                                   "recompute_attention), and run eagerly it would draw other masks than its "
                                   "compiled counterpart "
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
        patches["custom_partitioner_fn"] = Partitioner(region, self.passes, self.fidelity_probes, self.demotions)
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
                        **patches, "custom_partitioner_fn": Partitioner(region, self.passes,
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
