"""`fxmem bench context`: the longest sequence (batch 1) whose whole training step fits under a memory cap.

A step "fits" when the bytes that live across steps (weights, buffers, optimizer state: ``static_bytes``) plus the
step's own peak above them (``peak_memory``: activations, gradients, transients) stay under the cap. Each method is
measured at a few lengths: every probe builds, compiles and runs the model at that length for real (on a CPU the
cap is a figure to compare against, not an allocator limit); fxmem.fitting places them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fxmem.config import PUBLISHED_MIN_COSINE, Config, overrides_text
from fxmem.fitting import Probe, longest_fitting
from fxmem.measure import Fidelity, gradient_fidelity, peak_memory, static_bytes, trainable_gradients
from fxmem.timing import step_times
from fxmem_bench.choices import CONTEXT_BASELINES
from fxmem_bench.choices import CONTEXT_PRESETS as DEFAULT_PRESETS
from fxmem_bench.compare import METHOD_DESCRIPTIONS, check_runs_here, default_methods, forward_for_method
from fxmem_bench.workloads import Workload

LOWEST_BUDGET = 0.0  # compile-budget's lowest setting (see CONTEXT_BASELINES)
BASELINE_DESCRIPTIONS = {
    **{b: METHOD_DESCRIPTIONS[b] for b in CONTEXT_BASELINES},
    "compile-budget": f"inductor with activation_memory_budget {LOWEST_BUDGET}, its lowest setting"}


def default_baselines(device: torch.device | str, family: str = "llama") -> tuple[str, ...]:
    """Every one of CONTEXT_BASELINES that runs on ``device`` and on ``family``'s workloads."""
    return default_methods(device, family, CONTEXT_BASELINES)


@dataclass
class ContextResult:
    workload: str
    method: str  # a baseline, or "fxmem <preset>"
    memory_cap: int
    longest: int  # the longest length found to fit (0: none did)
    shortest_failing: int | None  # the shortest length found not to fit (None: none measured)
    probes: list[Probe] = field(default_factory=list)
    seconds_per_token: float | None = None  # a timed step at ``longest``, divided by its tokens
    fidelity: Fidelity | None = None  # fxmem at ``longest``: against eager's gradients at that length
    fidelity_bound: float | None = None
    converged: bool = True  # fxmem.fitting.Fit.converged: False, the search stopped with the two further apart

    @property
    def at_longest(self) -> Probe | None:
        return next((p for p in self.probes if p.seq == self.longest), None)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["fidelity"] = self.fidelity.to_dict() if self.fidelity else None
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ContextResult:
        fields = {**data, "probes": [Probe(**p) for p in data["probes"]],
                  "fidelity": Fidelity.from_dict(data["fidelity"]) if data.get("fidelity") else None}
        return cls(**fields)


@dataclass
class _Measured:
    probe: Probe
    step: Callable[[], None]
    grads: dict[str, torch.Tensor]


def first_step(workload: Workload, method: str, seq: int, *, config: Config, device: torch.device,
               lora_rank: int) -> _Measured:
    """``workload`` at batch 1 x ``seq`` under ``method``, after one step: compiled, with its optimizer state, and
    the gradients of the initial weights. Its probe's peak is not measured yet (0)."""
    torch._dynamo.reset()  # each length compiles its own graphs (dynamic=False), as a run at that length would
    setup = dataclasses.replace(workload, batch=1, seq=seq).build(device=device, lora_rank=lora_rank)
    budget = LOWEST_BUDGET if method == "compile-budget" else None
    forward = forward_for_method(method, setup.model, config, budget)
    batch = next(setup.batches)
    step, optimizer = setup.training_step(forward, batch)
    setup.loss(forward, batch).backward()
    grads = trainable_gradients(setup.model)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return _Measured(Probe(seq, 0, static_bytes(setup.model, optimizer)), step, grads)


def measure_length(workload: Workload, method: str, seq: int, *, config: Config, device: torch.device,
                   lora_rank: int) -> _Measured:
    """``first_step``, then a step whose peak is measured."""
    done = first_step(workload, method, seq, config=config, device=device, lora_rank=lora_rank)
    done.probe = dataclasses.replace(done.probe, peak_bytes=peak_memory(done.step, device))
    return done


def run_context(workload: Workload, memory_cap: int, *, presets: Sequence[str] = DEFAULT_PRESETS,
                baselines: Sequence[str] | None = None, device: torch.device | str = "cpu",
                lora_rank: int = 16, start: int = 512, granularity: int = 128, max_seq: int = 1 << 20,
                return_logits: bool = False, options: Mapping[str, Any] | None = None,
                progress: Callable[[str], None] = lambda message: None) -> list[ContextResult]:
    """Every baseline and fxmem preset's longest fitting length on ``workload`` (batch 1) under ``memory_cap``
    (``baselines``: default, default_baselines).

    At its longest length each method's step is timed once more, and each fxmem preset's gradients of the first
    step are compared with eager's at the same length and weights (eager runs there whatever its own peak: on a
    CPU the cap is only compared against; on a GPU a length that runs out of memory does not fit, and fidelity is
    left out where eager does). ``return_logits=False``: fxmem returns no logits, so its loss is
    chunked (Config.return_logits); ``options``: Config fields set on every preset (e.g. mlp_chunk,
    block_checkpoint), named in its label; the baselines run as HF runs them.
    """
    device = torch.device(device)
    baselines = default_baselines(device, workload.family) if baselines is None else tuple(baselines)
    unknown = [b for b in baselines if b not in CONTEXT_BASELINES]
    if unknown:
        raise ValueError(f"unknown baseline(s) {', '.join(unknown)}; valid baselines: {', '.join(CONTEXT_BASELINES)}")
    check_runs_here(baselines, device, workload.family)
    if not presets and not baselines:
        raise ValueError("nothing to measure: give at least one preset or baseline")
    runs = [(b, b, Config(), None) for b in baselines]
    options = dict(options or {})
    runs += [(f"fxmem {p}{overrides_text(options)}", "fxmem",
              Config.from_preset(p, return_logits=return_logits, **options), p) for p in presets]
    results = []
    for label, method, config, preset in runs:
        best: dict[str, Any] = {}  # the longest fitting length's timed step and first gradients

        def measure(seq: int, method: str = method, config: Config = config, label: str = label,
                    best: dict = best) -> Probe:
            progress(f"{workload.name}: {label} at {seq} tokens")
            try:
                done = measure_length(workload, method, seq, config=config, device=device, lora_rank=lora_rank)
            except torch.OutOfMemoryError:  # a real device limit below the cap: that length does not fit
                torch._dynamo.reset()
                torch.cuda.empty_cache()
                return Probe(seq, 0, 0, out_of_memory=True)
            if done.probe.fits(memory_cap) and seq > best.get("seq", 0):  # timed now: the next probe's dynamo
                best.update(seq=seq, grads=done.grads,  # reset drops its graphs
                            seconds=step_times(done.step, steps=1, warmup=0, device=device)[0])
            return done.probe

        fit = longest_fitting(measure, memory_cap, start=start, granularity=granularity, max_seq=max_seq)
        result = ContextResult(workload.name, label, memory_cap, fit.longest, fit.shortest_failing, fit.probes,
                               converged=fit.converged)
        if fit.longest:
            result.seconds_per_token = best["seconds"] / fit.longest
            if method == "fxmem":
                result.fidelity = _fidelity_against_eager(workload, fit.longest, best["grads"], device, lora_rank,
                                                          progress=lambda m, label=label: progress(f"{m}, for {label}"))
                result.fidelity_bound = PUBLISHED_MIN_COSINE.get(preset)
        results.append(result)
    torch._dynamo.reset()
    return results


def _fidelity_against_eager(workload: Workload, seq: int, grads: dict[str, torch.Tensor], device: torch.device,
                            lora_rank: int, progress: Callable[[str], None]) -> Fidelity | None:
    """``grads`` (a first step's at ``seq`` tokens) against eager PEFT's at the same length, weights and batch;
    None where eager runs out of device memory there."""
    progress(f"{workload.name}: eager's gradients at {seq} tokens")
    try:
        reference = first_step(workload, "eager", seq, config=Config(), device=device, lora_rank=lora_rank)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return gradient_fidelity(reference.grads, grads)
