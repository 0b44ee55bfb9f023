"""`fxmem finetune`: a short LoRA fine-tune on real text, with and without fxmem, side by side."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.measure import median, model_tensors, peak_memory, saved_activation_bytes, step_times
from fxmem.workloads import Workload

FINETUNE_METHODS = ("eager", "compile", "fxmem")


@dataclass
class FinetuneResult:
    method: str
    losses: list[float]
    saved_bytes: int  # measured on the first step
    peak_bytes: int  # measured on the second step
    first_step_seconds: float  # includes compilation
    step_seconds: float  # median of the steps after the second

    @property
    def final_loss(self) -> float:
        """Mean of the last five losses: one step's loss is noisy."""
        tail = self.losses[-5:]
        return sum(tail) / len(tail)


def finetune(workload: Workload, method: str, *, steps: int, lr: float = 1e-3, preset: str = "exact",
             device: torch.device | str = "cpu", lora_rank: int = 16,
             on_step: Callable[[int, float], None] = lambda step, loss: None) -> FinetuneResult:
    """Train ``workload`` for ``steps`` optimizer steps with ``method``; the same seed and batches for every method."""
    if method not in FINETUNE_METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(FINETUNE_METHODS)}")
    if steps < 3:
        raise ValueError(f"steps must be >= 3 (first step: saved bytes, second: peak memory); got {steps}")
    torch._dynamo.reset()
    setup = workload.build(device=device, lora_rank=lora_rank)
    forward = {"eager": lambda: setup.model, "compile": lambda: torch.compile(setup.model),
               "fxmem": lambda: torch.compile(setup.model, backend=Backend(Config.from_preset(preset)))}[method]()
    optimizer = torch.optim.AdamW([p for p in setup.model.parameters() if p.requires_grad], lr=lr)
    losses: list[float] = []

    def train_step(loss_of: Callable[[dict], torch.Tensor]) -> None:
        batch = next(setup.batches)
        loss = loss_of(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        on_step(len(losses), losses[-1])

    saved_box: list[int] = []

    def measured_loss(batch: dict) -> torch.Tensor:
        saved, loss = saved_activation_bytes(lambda: setup.loss(forward, batch),
                                             exclude=model_tensors(setup.model) + list(batch.values()))
        saved_box.append(saved)
        return loss

    def plain_loss(batch: dict) -> torch.Tensor:
        return setup.loss(forward, batch)

    first = step_times(lambda: train_step(measured_loss), steps=1, warmup=0, device=device)[0]
    peak = peak_memory(lambda: train_step(plain_loss), device)
    times = step_times(lambda: train_step(plain_loss), steps=steps - 2, warmup=0, device=device)
    torch._dynamo.reset()
    return FinetuneResult(method=method, losses=losses, saved_bytes=saved_box[0], peak_bytes=peak,
                          first_step_seconds=first, step_seconds=median(times))
