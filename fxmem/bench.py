"""`fxmem bench`: each workload under fxmem and the four baselines of ../shared/BENCHMARKS.md, in one process."""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.compile_fx import compile_fx

import fxmem
from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.measure import (
    Fidelity,
    gradient_fidelity,
    median,
    model_tensors,
    peak_memory,
    saved_activation_bytes,
    step_times,
    trainable_gradients,
)
from fxmem.workloads import Setup, Workload

METHODS = ("eager", "compile", "compile-budget", "hf-checkpointing", "fxmem")
METHOD_DESCRIPTIONS = {
    "eager": "eager PEFT LoRA (what most users run today)",
    "compile": "torch.compile, inductor defaults (min-cut rematerialization)",
    "compile-budget": "inductor with activation_memory_budget set to fxmem's saved bytes",
    "hf-checkpointing": "eager with HF gradient checkpointing",
    "fxmem": "torch.compile(backend=fxmem) with the chosen preset",
}


@dataclass
class MethodResult:
    workload: str
    method: str
    saved_bytes: int
    peak_bytes: int
    step_seconds: float  # median
    compile_seconds: float  # first step minus a warm step (0 for eager methods)
    first_loss: float
    fidelity: Fidelity | None = None  # vs eager, on the first batch
    budget: float | None = None  # activation_memory_budget, for compile-budget
    step_samples: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "method": self.method, "saved_bytes": self.saved_bytes,
                "peak_bytes": self.peak_bytes, "step_seconds": self.step_seconds,
                "step_samples": self.step_samples, "compile_seconds": self.compile_seconds,
                "first_loss": self.first_loss, "budget": self.budget,
                "fidelity": self.fidelity.to_dict() if self.fidelity else None}


def _budget_backend(budget: float) -> Callable:
    def compile_with_budget(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs)
    return compile_with_budget


def _forward_for(method: str, model: torch.nn.Module, config: Config, budget: float | None) -> Callable:
    if method == "eager":
        return model
    if method == "hf-checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    if method == "compile":
        return torch.compile(model)
    if method == "compile-budget":
        return torch.compile(model, backend=_budget_backend(budget))
    if method == "fxmem":
        return torch.compile(model, backend=Backend(config))
    raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")


def saved_bytes_at_budget(workload: Workload, budget: float, device: torch.device, lora_rank: int) -> int:
    """Bytes inductor's min-cut would save at ``budget``, from fxmem's analysis (no code generation)."""
    torch._dynamo.reset()
    setup = workload.build(device=device, lora_rank=lora_rank)
    batch = next(setup.batches)
    backend = Backend(Config(), lowering="eager")
    with torch._functorch.config.patch(activation_memory_budget=budget):
        setup.loss(torch.compile(setup.model, backend=backend), batch)
    return backend.report().activation_bytes


def budget_matching(workload: Workload, target_bytes: int, device: torch.device, lora_rank: int,
                    iterations: int = 7) -> float:
    """The largest activation_memory_budget whose saved bytes do not exceed ``target_bytes`` (bisection)."""
    if saved_bytes_at_budget(workload, 1.0, device, lora_rank) <= target_bytes:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        if saved_bytes_at_budget(workload, middle, device, lora_rank) <= target_bytes:
            low = middle
        else:
            high = middle
    return low


def run_method(workload: Workload, method: str, *, config: Config, device: torch.device, steps: int,
               lora_rank: int, budget: float | None = None,
               reference_grads: dict[str, torch.Tensor] | None = None) -> tuple[MethodResult, dict]:
    torch._dynamo.reset()
    setup: Setup = workload.build(device=device, lora_rank=lora_rank)
    forward = _forward_for(method, setup.model, config, budget)
    optimizer = torch.optim.AdamW([p for p in setup.model.parameters() if p.requires_grad], lr=1e-4)
    first_batch = next(setup.batches)
    first_losses: list[float] = []

    def first_batch_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = setup.loss(forward, first_batch)
        loss.backward()
        first_losses.append(loss.item())

    def step(batch: dict[str, torch.Tensor]) -> None:
        setup.loss(forward, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The first batch twice at the initial weights: its gradients (fidelity), and cold minus warm (compile time).
    cold, warm = (step_times(first_batch_backward, steps=1, warmup=0, device=device)[0] for _ in range(2))
    grads = trainable_gradients(setup.model)
    optimizer.zero_grad(set_to_none=True)

    batch = next(setup.batches)
    exclude = model_tensors(setup.model) + list(batch.values())
    saved, loss = saved_activation_bytes(lambda: setup.loss(forward, batch), exclude=exclude)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    peak = peak_memory(lambda: step(batch), device)
    samples = step_times(lambda: step(batch), steps=steps, warmup=1, device=device)
    result = MethodResult(
        workload=workload.name, method=method, saved_bytes=saved, peak_bytes=peak, step_seconds=median(samples),
        step_samples=samples, compile_seconds=max(cold - warm, 0.0), first_loss=first_losses[0],
        fidelity=gradient_fidelity(reference_grads, grads) if reference_grads is not None else None,
        budget=budget)
    return result, grads


def run_workload(workload: Workload, *, preset: str = "exact", device: torch.device | str = "cpu", steps: int = 5,
                 lora_rank: int = 16, methods: Sequence[str] = METHODS,
                 progress: Callable[[str], None] = lambda message: None) -> list[MethodResult]:
    """Every method on one workload; fidelity is measured against eager's gradients on the same batch."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid methods: {', '.join(METHODS)}")
    config = Config.from_preset(preset)
    device = torch.device(device)
    # eager first (the fidelity reference), fxmem before compile-budget (whose budget matches fxmem's bytes)
    order = [m for m in ("eager", "fxmem", "compile", "compile-budget", "hf-checkpointing") if m in methods]
    results: dict[str, MethodResult] = {}
    reference = None
    for method in order:
        budget = None
        if method == "compile-budget":
            target = results["fxmem"].saved_bytes if "fxmem" in results else None
            if target is None:
                raise ValueError("compile-budget needs the fxmem method in the same run (its budget matches fxmem)")
            progress(f"{workload.name}: searching the activation_memory_budget that matches fxmem's bytes")
            budget = budget_matching(workload, target, device, lora_rank)
        progress(f"{workload.name}: {method}")
        result, grads = run_method(workload, method, config=config, device=device, steps=steps,
                                   lora_rank=lora_rank, budget=budget, reference_grads=reference)
        if method == "eager":
            reference = grads
        results[method] = result
    torch._dynamo.reset()
    return [results[m] for m in METHODS if m in results]


def machine_description(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def bench_metadata(command: str, device: torch.device | str, preset: str) -> dict[str, Any]:
    return {"date": datetime.date.today().isoformat(), "machine": machine_description(device),
            "command": command, "preset": preset, "fxmem_version": fxmem.__version__}
