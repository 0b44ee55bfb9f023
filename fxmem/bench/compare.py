"""`fxmem bench compare`: each workload under fxmem and the baselines of ../shared/BENCHMARKS.md, in one
process."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.compile_fx import compile_fx
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fxmem.backend import Backend
from fxmem.bench.workloads import Setup, Workload
from fxmem.config import Config
from fxmem.measure import (
    Fidelity,
    gradient_fidelity,
    model_tensors,
    peak_memory,
    saved_activation_bytes,
    static_bytes,
    trainable_gradients,
)
from fxmem.timing import interleaved_step_times, median, step_times, warm_up_compiler

METHODS = ("eager", "compile", "compile-budget", "hf-checkpointing", "compile-checkpointing", "compile-sac", "fxmem")
METHOD_DESCRIPTIONS = {
    "eager": "eager PEFT LoRA (what most users run today)",
    "compile": "torch.compile, inductor defaults (min-cut rematerialization)",
    "compile-budget": "inductor with activation_memory_budget set to fxmem's saved bytes",
    "hf-checkpointing": "eager with HF gradient checkpointing",
    "compile-checkpointing": "torch.compile over HF gradient checkpointing (each decoder layer recomputed whole)",
    "compile-sac": "torch.compile with selective activation checkpointing per decoder layer: matmuls and attention "
                   "saved, everything else recomputed",
    "fxmem": "torch.compile(backend=fxmem) with the chosen preset",
}
# What selective activation checkpointing saves (the matmuls and attention, as torchtitan's op-level policy does);
# everything else, element-wise ops and norms, is recomputed in backward.
SAC_SAVED_OPS = frozenset(op for op in (
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default))


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> Any:
    """A checkpoint's context_fn: SAC_SAVED_OPS saved, the rest recomputed."""
    return create_selective_checkpoint_contexts(_sac_policy)


@dataclass
class MethodResult:
    workload: str
    method: str
    saved_bytes: int
    peak_bytes: int  # a full step's peak above its start
    static_bytes: int  # weights, buffers and optimizer state
    compile_seconds: float  # first step minus a warm step (0 for eager methods)
    first_loss: float
    fidelity: Fidelity | None = None  # vs eager, on the first batch
    budget: float | None = None  # activation_memory_budget, for compile-budget
    step_samples: list[float] = field(default_factory=list)
    label: str = ""  # the method as a table shows it, where one method runs in several settings
    fidelity_bound: float | None = None  # the preset's published worst cosine (fxmem points); None: exact

    @property
    def step_seconds(self) -> float:
        return median(self.step_samples)

    @property
    def meets_fidelity_bound(self) -> bool:
        """Exact methods carry 1.0; an fxmem point meets its preset's published worst cosine."""
        return self.fidelity_bound is None or self.fidelity is None or self.fidelity.min_cosine >= self.fidelity_bound

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "method": self.method, "saved_bytes": self.saved_bytes,
                "peak_bytes": self.peak_bytes, "static_bytes": self.static_bytes, "step_seconds": self.step_seconds,
                "step_samples": self.step_samples, "compile_seconds": self.compile_seconds,
                "first_loss": self.first_loss, "budget": self.budget, "label": self.label,
                "fidelity_bound": self.fidelity_bound,
                "fidelity": self.fidelity.to_dict() if self.fidelity else None}


def _budget_backend(budget: float) -> Callable:
    def compile_with_budget(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs)
    return compile_with_budget


def forward_for_method(method: str, model: torch.nn.Module, config: Config, budget: float | None = None
                       ) -> Callable:
    """What the training step calls under ``method``: the model itself, or a compiled wrapper of it."""
    if method == "eager":
        return model
    if method in ("hf-checkpointing", "compile-checkpointing", "compile-sac"):
        # HF's checkpointing of each decoder layer; SAC through the same call (its kwargs go to checkpoint())
        options: dict[str, Any] = {"use_reentrant": False}
        if method == "compile-sac":
            options["context_fn"] = selective_checkpoint_context
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
        return model if method == "hf-checkpointing" else torch.compile(model)
    if method == "compile":
        return torch.compile(model)
    if method == "compile-budget":
        return torch.compile(model, backend=_budget_backend(budget))
    if method == "fxmem":
        return torch.compile(model, backend=Backend(config))
    raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")


def planned_bytes(workload: Workload, config: Config, device: torch.device, lora_rank: int,
                  budget: float = 1.0) -> int:
    """Saved-activation bytes of ``config``'s plan when min-cut runs at ``budget``; no code generation."""
    torch._dynamo.reset()
    setup = workload.build(device=device, lora_rank=lora_rank)
    backend = Backend(config, lowering="eager")
    with torch._functorch.config.patch(activation_memory_budget=budget):
        setup.loss(torch.compile(setup.model, backend=backend), next(setup.batches))
    torch._dynamo.reset()
    return backend.report().planned_bytes


def budget_matching(workload: Workload, target_bytes: int, device: torch.device, lora_rank: int,
                    iterations: int = 7) -> float:
    """The largest activation_memory_budget at which inductor saves at most ``target_bytes`` (bisection)."""
    exact = Config()
    if planned_bytes(workload, exact, device, lora_rank) <= target_bytes:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        if planned_bytes(workload, exact, device, lora_rank, budget=middle) <= target_bytes:
            low = middle
        else:
            high = middle
    return low


@dataclass
class _Prepared:
    result: MethodResult
    grads: dict[str, torch.Tensor]
    step: Callable[[], None]


def prepare_method(workload: Workload, method: str, *, config: Config, device: torch.device, lora_rank: int,
                   budget: float | None, reference_grads: dict[str, torch.Tensor] | None, label: str = "") -> _Prepared:
    """Build and compile one method, and measure everything but its step time."""
    setup: Setup = workload.build(device=device, lora_rank=lora_rank)
    forward = forward_for_method(method, setup.model, config, budget)
    optimizer = torch.optim.AdamW([p for p in setup.model.parameters() if p.requires_grad], lr=1e-4)
    first_batch, batch = next(setup.batches), next(setup.batches)
    first_losses: list[float] = []

    def first_batch_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = setup.loss(forward, first_batch)
        loss.backward()
        first_losses.append(loss.item())

    def step() -> None:
        setup.loss(forward, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The first batch twice at the initial weights: its gradients (fidelity), and cold minus warm (compile time).
    cold, warm = (step_times(first_batch_backward, steps=1, warmup=0, device=device)[0] for _ in range(2))
    grads = trainable_gradients(setup.model)
    optimizer.zero_grad(set_to_none=True)
    saved, loss = saved_activation_bytes(lambda: setup.loss(forward, batch),
                                         exclude=model_tensors(setup.model) + list(batch.values()))
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    step()  # creates the optimizer state, so that the peak below is a steady step's
    result = MethodResult(
        workload=workload.name, method=method, saved_bytes=saved, peak_bytes=peak_memory(step, device),
        static_bytes=static_bytes(setup.model, optimizer), compile_seconds=max(cold - warm, 0.0),
        first_loss=first_losses[0], budget=budget, label=label or method,
        fidelity=gradient_fidelity(reference_grads, grads) if reference_grads is not None else None)
    return _Prepared(result=result, grads=grads, step=step)


def run_workload(workload: Workload, *, preset: str = "exact", device: torch.device | str = "cpu", steps: int = 5,
                 lora_rank: int = 16, methods: Sequence[str] = METHODS, return_logits: bool = True,
                 options: Mapping[str, Any] | None = None,
                 progress: Callable[[str], None] = lambda message: None) -> list[MethodResult]:
    """Every method on one workload, all kept alive so that their steps are timed interleaved.

    Fidelity is measured against eager's gradients on the same batch and weights. ``return_logits=False``: fxmem
    returns no logits (Config.return_logits), so it chunks the loss; the step reads only the loss. ``options``:
    further Config overrides of the preset.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid methods: {', '.join(METHODS)}")
    config = Config.from_preset(preset, **{"return_logits": return_logits, **(options or {})})
    device = torch.device(device)
    budget = None
    if "compile-budget" in methods:
        progress(f"{workload.name}: searching the activation_memory_budget that matches fxmem's bytes")
        budget = budget_matching(workload, planned_bytes(workload, config, device, lora_rank), device, lora_rank)
    torch._dynamo.reset()
    warm_up_compiler()
    prepared: dict[str, _Prepared] = {}
    reference = None
    # Every method compiles cold: a cache warmed by an earlier run (or method) would make compile times incomparable.
    with torch.compiler.config.patch(force_disable_caches=True):
        for method in sorted(methods, key=lambda m: m != "eager"):  # eager first: the fidelity reference
            progress(f"{workload.name}: {method}")
            prepared[method] = prepare_method(workload, method, config=config, device=device, lora_rank=lora_rank,
                                              budget=budget if method == "compile-budget" else None,
                                              reference_grads=reference)
            if method == "eager":
                reference = prepared[method].grads
    progress(f"{workload.name}: timing {steps} interleaved steps")
    time_interleaved(prepared, steps=steps, device=device)
    torch._dynamo.reset()
    return [prepared[m].result for m in METHODS if m in prepared]


def time_interleaved(prepared: dict[str, _Prepared], *, steps: int, device: torch.device) -> list[MethodResult]:
    """Every prepared method's steps, timed interleaved (one warm-up round); their results with the samples."""
    samples = interleaved_step_times({name: p.step for name, p in prepared.items()}, steps=steps, warmup=1,
                                     device=device)
    for name, p in prepared.items():
        p.result.step_samples = samples[name]
    return [p.result for p in prepared.values()]
