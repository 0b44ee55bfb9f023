"""`fxmem bench compare --frontier`: step peak against step time, fxmem and inductor's budget at the same targets.

Each target is a fraction of what torch.compile saves. compile-budget runs inductor with
``activation_memory_budget`` at the target; fxmem runs its preset with ``memory_budget`` at the target (its planner
spends the bytes cheapest first), and once more with the lowest-memory preset as its own last point. Eager PEFT,
torch.compile and HF checkpointing are single points. Every method is built and compiled in one process and
their steps are timed interleaved, so the points compare. fxmem wins a compile-budget point when one of its
points has no higher step peak, a lower step time with the ranges of the interleaved rounds apart (its
slowest round's ratio to torch.compile below their fastest), and a worst gradient cosine at its preset's
published figure (config.PUBLISHED_MIN_COSINE) or above.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxmem.config import PUBLISHED_MIN_COSINE, Config
from fxmem.timing import round_ratio, warm_up_compiler
from fxmem_bench.choices import FRONTIER_TARGETS as DEFAULT_TARGETS
from fxmem_bench.compare import MethodResult, prepare_method, time_interleaved
from fxmem_bench.workloads import Workload


@dataclass(frozen=True)
class Point:
    """One method of the frontier: how it is built, and its label."""

    method: str
    config: Config = Config()
    budget: float | None = None  # compile-budget's activation_memory_budget
    label: str = ""
    preset: str | None = None  # fxmem's: whose published fidelity the point must meet


def frontier_points(targets: Sequence[float], preset: str, lowest: str,
                    overrides: Mapping[str, Any] | None = None) -> list[Point]:
    """The frontier's points; ``overrides`` (Config fields) apply to fxmem's memory_budget series and name it."""
    overrides = dict(overrides or {})
    series = " ".join([preset, *(f"{name}={value}" for name, value in overrides.items())])
    points = [Point("eager", label="eager"), Point("compile", label="compile"),
              Point("hf-checkpointing", label="hf-checkpointing")]
    for target in targets:
        points.append(Point("compile-budget", budget=target, label=f"compile-budget {target:g}"))
        points.append(Point("fxmem", Config.from_preset(preset, memory_budget=target, **overrides),
                            label=f"fxmem {series} {target:g}", preset=preset))
    points.append(Point("fxmem", Config.from_preset(lowest), label=f"fxmem {lowest}", preset=lowest))
    return points


def run_frontier(workload: Workload, *, targets: Sequence[float] = DEFAULT_TARGETS, preset: str = "hyclora-4bit",
                 overrides: Mapping[str, Any] | None = None, lowest: str = "hyclora-2bit",
                 device: torch.device | str = "cpu", steps: int = 5, lora_rank: int = 16,
                 progress: Callable[[str], None] = lambda message: None) -> list[MethodResult]:
    """Every point on one workload, gradients against eager's, steps timed interleaved; ``overrides`` as
    frontier_points takes them."""
    device = torch.device(device)
    torch._dynamo.reset()
    warm_up_compiler()
    prepared, reference = {}, None
    points = frontier_points(targets, preset, lowest, overrides)
    # every compiled point is another compile of the same model class: past dynamo's limit it would run eager
    limit = max(torch._dynamo.config.recompile_limit, len(points))
    with torch.compiler.config.patch(force_disable_caches=True), torch._dynamo.config.patch(recompile_limit=limit):
        for point in points:
            progress(f"{workload.name}: {point.label}")
            prepared[point.label] = prepare_method(workload, point.method, config=point.config, device=device,
                                                   lora_rank=lora_rank, budget=point.budget,
                                                   reference_grads=reference, label=point.label)
            if point.method == "eager":
                reference = prepared[point.label].grads
            if point.preset:
                prepared[point.label].result.fidelity_bound = PUBLISHED_MIN_COSINE[point.preset]
        progress(f"{workload.name}: timing {steps} interleaved steps")
        results = time_interleaved(prepared, steps=steps, device=device)
    torch._dynamo.reset()
    return results


def wins(results: Sequence[MethodResult]) -> list[tuple[MethodResult, MethodResult | None]]:
    """For each compile-budget point, the fastest fxmem point with no higher step peak, faster with the rounds'
    ranges apart, and at its preset's published fidelity (None where there is none)."""
    compiled = next(r for r in results if r.method == "compile")
    ours = [r for r in results if r.method == "fxmem" and r.meets_fidelity_bound]
    verdicts = []
    for theirs in (r for r in results if r.method == "compile-budget"):
        better = [r for r in ours if r.peak_bytes <= theirs.peak_bytes and _faster_beyond_spread(r, theirs, compiled)]
        verdicts.append((theirs, min(better, key=lambda r: r.step_seconds) if better else None))
    return verdicts


def _faster_beyond_spread(ours: MethodResult, theirs: MethodResult, compiled: MethodResult) -> bool:
    """Faster with no overlap: the slowest of our rounds, as a ratio to torch.compile's, below the fastest of
    theirs (the ranges the table prints)."""
    return round_ratio(ours.step_samples, compiled.step_samples).high < \
        round_ratio(theirs.step_samples, compiled.step_samples).low


def plot(results: Sequence[MethodResult], path: pathlib.Path) -> None:
    """Step peak (x) against step time relative to torch.compile's (y), one marker per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    compiled = next(r for r in results if r.method == "compile").step_seconds
    figure, axes = plt.subplots(figsize=(7, 4.5))
    styles = {"compile-budget": ("s", "tab:blue"), "fxmem": ("o", "tab:red"), "eager": ("^", "gray"),
              "compile": ("D", "black"), "hf-checkpointing": ("v", "tab:green")}
    for method, (marker, color) in styles.items():
        chosen = sorted((r for r in results if r.method == method), key=lambda r: r.peak_bytes)
        if not chosen:
            continue
        xs = [r.peak_bytes / 2**20 for r in chosen]
        ys = [r.step_seconds / compiled for r in chosen]
        axes.plot(xs, ys, marker=marker, color=color, label=method, linestyle="-" if len(chosen) > 1 else "")
        for r, x, y in zip(chosen, xs, ys, strict=True):
            axes.annotate(r.label.split()[-1] if r.method in ("fxmem", "compile-budget") else "", (x, y),
                          textcoords="offset points", xytext=(4, 4), fontsize=7)
    axes.set_xlabel("step peak (MiB above the step's start)")
    axes.set_ylabel("step time / torch.compile's")
    axes.set_title(f"{results[0].workload}: memory/time frontier", fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
