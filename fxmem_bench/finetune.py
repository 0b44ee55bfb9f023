"""`fxmem bench finetune`: a short LoRA fine-tune on real text, with and without fxmem, side by side."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from fxmem.config import Config
from fxmem.measure import (
    Fidelity,
    gradient_fidelity,
    model_tensors,
    peak_memory,
    saved_activation_bytes,
    trainable_gradients,
)
from fxmem.timing import median, step_times, warm_up_compiler
from fxmem_bench.compare import forward_for_method
from fxmem_bench.workloads import Workload

FINETUNE_METHODS = ("eager", "compile", "hf-checkpointing", "fxmem")


@dataclass
class FinetuneResult:
    method: str
    losses: list[float]
    saved_bytes: int  # measured on the first step
    peak_bytes: int  # the second step's peak above its start
    first_step_seconds: float  # includes compilation, with inductor's caches off
    step_seconds: float  # median of the steps after the second

    @property
    def final_loss(self) -> float:
        """Mean of the last five losses: one step's loss is noisy."""
        tail = self.losses[-5:]
        return sum(tail) / len(tail)


def check_methods(methods: Sequence[str]) -> None:
    unknown = [m for m in methods if m not in FINETUNE_METHODS]
    if unknown:
        raise ValueError(f"unknown method {', '.join(map(repr, unknown))}; valid methods: "
                         f"{', '.join(FINETUNE_METHODS)}")


class FinetuneRun:
    """One method's training loop, advanced a step at a time: the first step also measures the saved bytes,
    the second the peak memory, the others are timed."""

    def __init__(self, workload: Workload, method: str, *, lr: float = 1e-3, preset: str = "exact",
                 config: Config | None = None, device: torch.device | str = "cpu", lora_rank: int = 16) -> None:
        check_methods([method])
        self.method = method
        self.device = torch.device(device)
        self.setup = workload.build(device=device, lora_rank=lora_rank)
        # Taken first, so every run trains on the same batches; gradient probes use it.
        self.probe_batch = next(self.setup.batches)
        self.forward = forward_for_method(method, self.setup.model, config or Config.from_preset(preset))
        self.optimizer = torch.optim.AdamW([p for p in self.setup.model.parameters() if p.requires_grad], lr=lr)
        self.losses: list[float] = []
        self.saved_bytes = self.peak_bytes = 0
        self.seconds: list[float] = []

    def _train_step(self, measure_saved: bool) -> None:
        batch = next(self.setup.batches)
        if measure_saved:
            exclude = model_tensors(self.setup.model) + list(batch.values())
            self.saved_bytes, loss = saved_activation_bytes(lambda: self.setup.loss(self.forward, batch), exclude)
        else:
            loss = self.setup.loss(self.forward, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())

    def step(self) -> float:
        """One optimizer step; returns its loss."""
        if len(self.losses) == 1:
            self.peak_bytes = peak_memory(lambda: self._train_step(False), self.device)
            return self.losses[-1]
        if self.losses:
            [seconds] = step_times(lambda: self._train_step(False), steps=1, warmup=0, device=self.device)
        else:  # compiles cold, as in the benchmark: kernels another method cached would skew first steps
            with torch.compiler.config.patch(force_disable_caches=True):
                [seconds] = step_times(lambda: self._train_step(True), steps=1, warmup=0, device=self.device)
        self.seconds.append(seconds)
        return self.losses[-1]

    def gradient_probe(self) -> Fidelity:
        """Gradients on the probe batch at the current weights, against the eager model's on the same."""
        grads = []
        for forward in (self.setup.model, self.forward):
            self.setup.loss(forward, self.probe_batch).backward()
            grads.append(trainable_gradients(self.setup.model))
            self.optimizer.zero_grad(set_to_none=True)
        return gradient_fidelity(*grads)

    def result(self) -> FinetuneResult:
        if len(self.losses) < 3:
            raise ValueError(f"{self.method}: a result needs at least 3 steps (got {len(self.losses)})")
        return FinetuneResult(method=self.method, losses=self.losses, saved_bytes=self.saved_bytes,
                              peak_bytes=self.peak_bytes, first_step_seconds=self.seconds[0],
                              step_seconds=median(self.seconds[1:]))


def round_robin(runs: int, steps: int) -> Iterator[tuple[int, int]]:
    """(step, run index) for ``steps`` steps of every run, each step starting one run later than the last,
    so that the machine's drift does not favour a run."""
    for step in range(1, steps + 1):
        for offset in range(runs):
            yield step, (step - 1 + offset) % runs


def finetune(workload: Workload, methods: Sequence[str] = FINETUNE_METHODS, *, steps: int, lr: float = 1e-3,
             preset: str = "exact", device: torch.device | str = "cpu", lora_rank: int = 16,
             on_step: Callable[[str, int, float], None] = lambda method, step, loss: None
             ) -> list[FinetuneResult]:
    """Train ``workload`` with each method on the same seed and batches, their steps interleaved round-robin
    so that the machine's drift does not enter the time ratios."""
    check_methods(methods)
    if steps < 3:
        raise ValueError(f"steps must be >= 3 (first step: saved bytes, second: peak memory); got {steps}")
    torch._dynamo.reset()
    warm_up_compiler()
    runs = [FinetuneRun(workload, m, lr=lr, preset=preset, device=device, lora_rank=lora_rank) for m in methods]
    for step, index in round_robin(len(runs), steps):
        on_step(runs[index].method, step, runs[index].step())
    torch._dynamo.reset()
    return [run.result() for run in runs]
