"""`fxmem bench profile`: where one training step's time goes, and what compression costs of it.

Compression's cost is measured, not attributed: the same workload is compiled twice with the same config, once
with every pass and once without the passes that store saved tensors compressed (quantize, lowrank,
sparsify_attention), so that everything else (the recomputations, the LoRA rebuilds) is alike, and a third time
by torch.compile alone. The three steps are timed interleaved; the difference of the first two medians is what
compressing and decompressing cost, that of the last two what the rest of fxmem's plan costs. Inductor
fuses the compression into the kernels that produce and consume the saved tensors, so no kernel's time is
compression's alone: the profiler's table beside it shows the kernels the step spends its time in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fxmem.backend import Backend
from fxmem.bench.workloads import Workload
from fxmem.config import Config
from fxmem.passes import PassManager
from fxmem.techniques import default_passes
from fxmem.timing import interleaved_step_times, median, warm_up_compiler

COMPRESSION_PASSES = ("quantize", "lowrank", "sparsify_attention")


@dataclass
class StepProfile:
    workload: str
    preset: str
    step_samples: list[float]  # fxmem's steps
    uncompressed_samples: list[float]  # the same plan without the compression passes, timed interleaved
    compile_samples: list[float]  # torch.compile's, timed interleaved
    top: list[tuple[str, float, int]] = field(default_factory=list)  # (op or kernel, self seconds, calls)
    profiled_seconds: float = 0.0  # the profiled step's total self time (the profiler's own overhead included)

    @property
    def compression_seconds(self) -> float:
        return median(self.step_samples) - median(self.uncompressed_samples)

    @property
    def compression_share(self) -> float:
        return self.compression_seconds / median(self.step_samples)

    def to_dict(self) -> dict:
        return {"workload": self.workload, "preset": self.preset, "step_samples": self.step_samples,
                "uncompressed_samples": self.uncompressed_samples, "compile_samples": self.compile_samples,
                "compression_seconds": self.compression_seconds,
                "compression_share": self.compression_share, "profiled_seconds": self.profiled_seconds,
                "top": [{"name": n, "seconds": s, "calls": c} for n, s, c in self.top]}


def _training_step(workload: Workload, backend: Backend | str, device: torch.device) -> Callable[[], None]:
    setup = workload.build(device=device)
    forward = torch.compile(setup.model, backend=backend)
    return setup.training_step(forward, next(setup.batches))[0]


def profile_step(workload: Workload, preset: str, *, steps: int = 5, top: int = 15, device: str = "cpu",
                 progress: Callable[[str], None] = lambda message: None) -> StepProfile:
    """The step time of ``preset`` with and without its compression passes, and the profiler's busiest entries."""
    device = torch.device(device)
    config = Config.from_preset(preset)
    uncompressed = PassManager([p for p in default_passes() if p.name not in COMPRESSION_PASSES])
    torch._dynamo.reset()
    warm_up_compiler()
    # Inductor's CPU kernels appear in the profiler by name only when compiled with kernel profiling on.
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        progress(f"{workload.name}: compiling fxmem ({preset})")
        compressed = _training_step(workload, Backend(config), device)
        compressed()
        progress(f"{workload.name}: compiling fxmem ({preset}) without compression")
        plain = _training_step(workload, Backend(config, passes=uncompressed), device)
        plain()
        progress(f"{workload.name}: compiling torch.compile")
        baseline = _training_step(workload, "inductor", device)
        baseline()
    progress(f"{workload.name}: timing {steps} interleaved steps")
    times = interleaved_step_times({"fxmem": compressed, "uncompressed": plain, "compile": baseline}, steps=steps,
                                   warmup=1, device=device)
    progress(f"{workload.name}: profiling one step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        compressed()
    events = [e for e in profiler.key_averages() if e.self_cpu_time_total > 0]
    busiest = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    torch._dynamo.reset()
    return StepProfile(workload.name, preset, times["fxmem"], times["uncompressed"], times["compile"],
                       [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in busiest],
                       sum(e.self_cpu_time_total for e in events) / 1e6)
