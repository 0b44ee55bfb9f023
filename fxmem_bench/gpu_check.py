"""`fxmem bench gpu-check`: the GPU step table, measured the same way by whoever is lent a GPU.

At Llama-3-8B's layer shape (workload ``llama3-8b-shape``: 4 layers, bf16, 2 x 2048 tokens, PEFT LoRA r=16 on
every linear with fp32 adapters), each point of ``POINTS`` is built from the same seeded weights and compiled in one
process: eager PEFT, torch.compile, inductor's ``activation_memory_budget`` at 0.15 and 0.05, HF gradient
checkpointing, and fxmem's presets with and without the logits returned (and hyclora-4bit with its LoRA products
kept fp32, to show what the half-precision products buy; and with its blocks checkpointed, their stored inputs on
the device and in host memory, ``block_offload``). For each: the step peak above the weights and optimizer
state, the worst LoRA-gradient cosine against eager on the first batch, then every point's training step timed
interleaved, as ratios to torch.compile's. Last, one profiled training step (optimizer included) of fxmem's
hyclora-4bit without logits and of torch.compile: their busiest kernels and the kernels each launches
(profile.py's count; on a GPU its kernel and copy events).

Each point is compiled with inductor's caches on: compile times are not what this checks, and a second run on the
same machine then costs little. On the CPU (``--device cpu``) it runs on any llama workload, for its mechanics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fxmem.config import PUBLISHED_MIN_COSINE
from fxmem.measure import format_bytes
from fxmem.timing import median, warm_up_compiler
from fxmem_bench.choices import POINT_KEYS, POINTS
from fxmem_bench.compare import MethodResult, prepare_method, time_interleaved
from fxmem_bench.profile import launched_kernels, profiled
from fxmem_bench.workloads import Workload

PROFILED = ("hyclora-4bit-no-logits", "compile")  # the profiled points, where they run
# What the issue asks of the step, as (point, the most its step may take as a fraction of torch.compile's)
STEP_TARGETS = (("exact-no-logits", 1.00), ("hyclora-4bit-no-logits", 1.10), ("hyclora-4bit-no-logits", 1.00))


@dataclass
class Profiled:
    key: str
    launches: int
    top: list[tuple[str, float, int]]  # (kernel or op, device seconds (CPU: self seconds), calls)


@dataclass
class GpuCheck:
    workload: str
    device: str
    results: list[MethodResult]
    keys: list[str]  # each result's point
    profiles: list[Profiled] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # point -> its error, where one failed to run

    def step_ratio(self, key: str) -> float | None:
        """A point's median step over torch.compile's; None where either did not run."""
        by_key = dict(zip(self.keys, self.results, strict=True))
        if key not in by_key or "compile" not in by_key:
            return None
        return median(by_key[key].step_samples) / median(by_key["compile"].step_samples)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "device": self.device,
                "points": [{"point": key, **result.to_dict(),
                            "step_vs_compile": self.step_ratio(key)}
                           for key, result in zip(self.keys, self.results, strict=True)],
                "profiles": [{"point": p.key, "launches": p.launches,
                              "top": [{"name": n, "seconds": s, "calls": c} for n, s, c in p.top]}
                             for p in self.profiles],
                "failures": self.failures}


def check_points(keys: Sequence[str]) -> None:
    unknown = [k for k in keys if k not in POINT_KEYS]
    if unknown:
        raise ValueError(f"unknown point(s) {', '.join(unknown)}; valid points: {', '.join(POINT_KEYS)}")
    if "eager" not in keys:
        raise ValueError("the gradients are compared against eager's: add the point eager")


def run_gpu_check(workload: Workload, *, device: torch.device | str = "cuda", keys: Sequence[str] = POINT_KEYS,
                  steps: int = 3, top: int = 10, lora_rank: int = 16,
                  progress: Callable[[str], None] = lambda message: None) -> GpuCheck:
    """Every point named in ``keys`` (eager among them), prepared, then timed interleaved, then profiled."""
    check_points(keys)
    device = torch.device(device)
    points = [p for p in POINTS if p.key in keys]
    torch._dynamo.reset()
    warm_up_compiler()
    prepared, reference, failures = {}, None, {}
    # inductor's CPU kernels appear in the profiler (and so in the launch count) only when compiled to
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": device.type == "cpu"}):
        for point in points:  # eager first (POINTS' order): the gradients' reference
            progress(f"{workload.name}: {point.label}")
            try:
                done = prepare_method(workload, point.method, config=point.config(), device=device,
                                      lora_rank=lora_rank, budget=point.budget, reference_grads=reference,
                                      label=point.label)
            except Exception as error:  # one point's failure is a finding; the others still run
                if point.key == "eager":
                    raise  # the gradients' reference
                failures[point.key] = f"{type(error).__name__}: {error}"
                progress(f"{point.label} failed: {failures[point.key]}")
                torch._dynamo.reset()
                continue
            reference = done.grads if point.key == "eager" else reference
            if point.method == "fxmem":
                done.result.fidelity_bound = PUBLISHED_MIN_COSINE[point.preset]
            done.grads = {}  # the reference alone is kept: a model's worth of gradients each
            prepared[point.key] = done
            progress(_prepared_line(point.label, done.result))  # a run stopped later still leaves these
    progress(f"{workload.name}: timing {steps} interleaved steps")
    time_interleaved(prepared, steps=steps, device=device)
    profiles = []
    for key in (k for k in PROFILED if k in prepared):
        progress(f"{workload.name}: profiling {key}")
        profiles.append(_profile(key, prepared[key].step, device, top))
    torch._dynamo.reset()
    return GpuCheck(workload.name, str(device), [p.result for p in prepared.values()], list(prepared), profiles,
                    failures)


def _prepared_line(label: str, result: MethodResult) -> str:
    cosine = f"{result.fidelity.min_cosine:.4f}" if result.fidelity else "(reference)"
    return (f"{label}: step peak {format_bytes(result.peak_bytes)}, saved {format_bytes(result.saved_bytes)}, "
            f"min LoRA-grad cos {cosine}, compile {result.compile_seconds:.0f} s")


def _profile(key: str, step: Callable[[], None], device: torch.device, top: int) -> Profiled:
    profiler = profiled(step, device)
    events = list(profiler.events())
    on_device = device.type == "cuda"

    def seconds(entry: Any) -> float:
        return (entry.self_device_time_total if on_device else entry.self_cpu_time_total) / 1e6

    busiest = sorted((e for e in profiler.key_averages() if seconds(e) > 0), key=seconds, reverse=True)[:top]
    return Profiled(key, launched_kernels(events, device), [(e.key, seconds(e), e.count) for e in busiest])
