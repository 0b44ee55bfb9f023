"""`fxmem bench profile`: where one training step's time goes, and what compression costs of it.

Compression's cost is measured, not attributed: the same workload is compiled twice with the same config, once
with every pass and once without the passes that store saved tensors compressed (quantize, lowrank,
sparsify_attention), so that everything else (the recomputations, the LoRA rebuilds) is alike, and a third time
by torch.compile alone. The three steps are timed interleaved; the difference of the first two medians is what
compressing and decompressing cost, that of the last two what the rest of fxmem's plan costs. Inductor
fuses the compression into the kernels that produce and consume the saved tensors, so no kernel's time is
compression's alone: the profiler's table beside it shows the kernels the step spends its time in.

Kernels launched per step (forward and backward, the optimizer left out) are counted for fxmem's step and
torch.compile's: on a GPU, the device's kernel events; on the CPU, where launching costs nothing but the count is
what a GPU would launch, the profiler's events that run one kernel (``launched_kernels``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.passes import PassManager
from fxmem.techniques import default_passes
from fxmem.timing import interleaved_step_times, median, warm_up_compiler
from fxmem_bench.workloads import Workload

COMPRESSION_PASSES = ("quantize", "lowrank", "sparsify_attention")
# aten ops that run no kernel of their own: views, allocations, metadata, and the wrappers that copy (through a
# copy_ of their own, counted) or return their input unchanged
NO_KERNEL_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::as_strided", "aten::as_strided_", "aten::view",
    "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::t", "aten::transpose", "aten::permute",
    "aten::expand", "aten::expand_as", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice",
    "aten::narrow", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::chunk", "aten::alias",
    "aten::detach", "aten::detach_", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::to",
    "aten::contiguous", "aten::flatten", "aten::type_as", "aten::promote_types", "aten::result_type",
    "aten::_local_scalar_dense", "aten::set_", "aten::resize_", "aten::numpy_T", "aten::matrix_H", "aten::mT",
})
GENERATED_KERNEL_MARKS = ("cpp_fused", "triton_")  # inductor's kernels, by name (CPU ones with kernel profiling on)


@dataclass
class StepProfile:
    workload: str
    preset: str
    step_samples: list[float]  # fxmem's steps
    uncompressed_samples: list[float]  # the same plan without the compression passes, timed interleaved
    compile_samples: list[float]  # torch.compile's, timed interleaved
    top: list[tuple[str, float, int]] = field(default_factory=list)  # (op or kernel, self seconds, calls)
    profiled_seconds: float = 0.0  # the profiled step's total self time (the profiler's own overhead included)
    launches: int = 0  # kernels fxmem's forward and backward launch
    compile_launches: int = 0  # torch.compile's

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
                "launches": self.launches, "compile_launches": self.compile_launches,
                "top": [{"name": n, "seconds": s, "calls": c} for n, s, c in self.top]}


@dataclass
class _Compiled:
    step: Callable[[], None]  # a training step, optimizer included
    forward_backward: Callable[[], None]  # the same batch's forward and backward alone


def _compiled(workload: Workload, backend: Backend | str, device: torch.device) -> _Compiled:
    setup = workload.build(device=device)
    forward = torch.compile(setup.model, backend=backend)
    batch = next(setup.batches)

    def forward_backward() -> None:
        setup.loss(forward, batch).backward()
        setup.model.zero_grad(set_to_none=True)
    return _Compiled(setup.training_step(forward, batch)[0], forward_backward)


def launched_kernels(events: list[Any], device: torch.device) -> int:
    """Kernels the profiled events ran. On a GPU: its kernel events. On the CPU: inductor's generated kernels, and
    each aten op that does work (not in ``NO_KERNEL_OPS``) with no such op inside it (``aten::mm`` is one kernel;
    ``aten::to`` is its ``copy_``, or none)."""
    if device.type == "cuda":
        return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)

    def generated(event: Any) -> bool:
        return any(mark in event.name for mark in GENERATED_KERNEL_MARKS)

    def runs_kernel(event: Any) -> bool:
        return event.name.startswith("aten::") and event.name not in NO_KERNEL_OPS

    def kernels_within(event: Any) -> int:
        if generated(event):
            return 1
        return sum(kernels_within(child) for child in event.cpu_children) or int(runs_kernel(event))
    return sum(kernels_within(e) for e in events if e.cpu_parent is None)


def profiled(run: Callable[[], object], device: torch.device) -> torch.profiler.profile:
    """``run`` once under the profiler: its CPU events, and on a GPU the device's too."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        run()
    return profiler


def _launches(forward_backward: Callable[[], None], device: torch.device) -> int:
    return launched_kernels(list(profiled(forward_backward, device).events()), device)


def profile_step(workload: Workload, preset: str, *, steps: int = 5, top: int = 15, device: str = "cpu",
                 return_logits: bool = True, progress: Callable[[str], None] = lambda message: None) -> StepProfile:
    """The step time of ``preset`` with and without its compression passes, and the profiler's busiest entries.
    ``return_logits=False``: fxmem returns no logits, and chunks the loss."""
    device = torch.device(device)
    config = Config.from_preset(preset, return_logits=return_logits)
    uncompressed = PassManager([p for p in default_passes() if p.name not in COMPRESSION_PASSES])
    torch._dynamo.reset()
    warm_up_compiler()
    # Inductor's CPU kernels appear in the profiler by name only when compiled with kernel profiling on.
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        progress(f"{workload.name}: compiling fxmem ({preset})")
        compressed = _compiled(workload, Backend(config), device)
        compressed.step()
        progress(f"{workload.name}: compiling fxmem ({preset}) without compression")
        plain = _compiled(workload, Backend(config, passes=uncompressed), device)
        plain.step()
        progress(f"{workload.name}: compiling torch.compile")
        baseline = _compiled(workload, "inductor", device)
        baseline.step()
    progress(f"{workload.name}: timing {steps} interleaved steps")
    times = interleaved_step_times({"fxmem": compressed.step, "uncompressed": plain.step, "compile": baseline.step},
                                   steps=steps, warmup=1, device=device)
    progress(f"{workload.name}: profiling one step")
    launches = _launches(compressed.forward_backward, device), _launches(baseline.forward_backward, device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        compressed.step()
    events = [e for e in profiler.key_averages() if e.self_cpu_time_total > 0]
    busiest = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    torch._dynamo.reset()
    return StepProfile(workload.name, preset, times["fxmem"], times["uncompressed"], times["compile"],
                       [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in busiest],
                       sum(e.self_cpu_time_total for e in events) / 1e6, *launches)
