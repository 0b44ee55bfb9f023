"""The LM head and its cross-entropy alone, side by side: fxmem's chunked loss against every way torch has.

Each method computes ``cross_entropy(linear(x, W).float(), target)`` and its backward for one batch of tokens (a
tenth of them ignored, as padding is), on the same tensors; peaks and times are measured in one process, the
times interleaved. The head's weight is frozen (a LoRA fine-tune) unless ``train_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.measure import peak_memory
from fxmem.timing import interleaved_step_times, median, warm_up_compiler
from fxmem_bench.choices import LOSS_METHODS

LOSS_METHOD_DESCRIPTIONS = {
    "unfused": "eager F.linear then F.cross_entropy on the float32 logits (HF's loss)",
    "unfused-compile": "the same under torch.compile (inductor defaults)",
    "auto-chunker": "the same under torch.compile with inductor's auto_chunker.enable",
    "linear-cross-entropy": "torch.nn.functional.linear_cross_entropy, options=None (its reference path)",
    "linear-cross-entropy-chunked": "torch.nn.functional.linear_cross_entropy, LinearCrossEntropyOptions() "
                                    "(its chunked path, chunk size 'auto')",
    "fxmem": "the unfused loss under torch.compile(backend=fxmem): chunk_loss rewrites it",
}
IGNORED_SHARE = 0.1


@dataclass(frozen=True)
class LossShape:
    tokens: int
    hidden: int
    vocab: int
    dtype: torch.dtype = torch.float32


@dataclass
class LossResult:
    method: str
    peak_bytes: int  # forward + backward, above what was allocated before
    loss_error: float  # |loss - unfused eager's| / |unfused eager's|
    grad_error: float  # max |grad - unfused eager's| / max |unfused eager's|, over the trained tensors
    step_samples: list[float] = field(default_factory=list)

    @property
    def step_seconds(self) -> float:
        return median(self.step_samples)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "peak_bytes": self.peak_bytes, "loss_error": self.loss_error,
                "grad_error": self.grad_error, "step_seconds": self.step_seconds, "step_samples": self.step_samples}


def _unfused(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, weight).float(), target)


def _loss_function(method: str) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    if method == "unfused":
        return _unfused
    if method == "unfused-compile":
        return torch.compile(_unfused)
    if method == "auto-chunker":
        return torch.compile(_unfused, options={"auto_chunker.enable": True})
    if method in ("linear-cross-entropy", "linear-cross-entropy-chunked"):
        options = torch.nn.LinearCrossEntropyOptions() if method.endswith("chunked") else None
        return lambda x, weight, target: torch.nn.functional.linear_cross_entropy(
            x, weight, target, ignore_index=-100, options=options)
    if method == "fxmem":
        return torch.compile(_unfused, backend=Backend(Config()))
    raise ValueError(f"unknown loss method {method!r}; valid methods: {', '.join(LOSS_METHODS)}")


def run_loss(shape: LossShape, *, methods: tuple[str, ...] = LOSS_METHODS, steps: int = 3,
             train_head: bool = False, device: torch.device | str = "cpu", seed: int = 0,
             progress: Callable[[str], None] = lambda message: None) -> list[LossResult]:
    """Every method's peak, step time and error against the unfused eager loss on one batch (which always runs:
    it is the reference)."""
    unknown = [m for m in methods if m not in LOSS_METHODS]
    if unknown:
        raise ValueError(f"unknown loss method(s) {', '.join(unknown)}; valid methods: {', '.join(LOSS_METHODS)}")
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape.tokens, shape.hidden, generator=generator).to(device, shape.dtype).requires_grad_()
    weight = (torch.randn(shape.vocab, shape.hidden, generator=generator) / shape.hidden ** 0.5).to(
        device, shape.dtype).requires_grad_(train_head)
    target = torch.randint(0, shape.vocab, (shape.tokens,), generator=generator)
    target[torch.rand(shape.tokens, generator=generator) < IGNORED_SHARE] = -100
    target = target.to(device)
    trained = [x, weight] if train_head else [x]

    def step_of(loss_fn: Callable) -> Callable[[], torch.Tensor]:
        def step() -> torch.Tensor:
            for t in trained:
                t.grad = None
            loss = loss_fn(x, weight, target)
            loss.backward()
            return loss.detach()
        return step

    torch._dynamo.reset()
    warm_up_compiler()
    steps_by_method, results = {}, {}
    reference_loss, reference_grads = None, None
    for method in ("unfused", *[m for m in methods if m != "unfused"]):
        progress(f"loss: {method}")
        step = step_of(_loss_function(method))
        loss = step()  # compiles, outside the peak
        grads = [t.grad.clone() for t in trained]
        if reference_loss is None:
            reference_loss, reference_grads = loss, grads
        peak = peak_memory(step, device)
        grad_error = max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference_grads))
        results[method] = LossResult(method, peak, float((loss - reference_loss).abs() / reference_loss.abs()),
                                     grad_error)
        steps_by_method[method] = step
    progress(f"loss: timing {steps} interleaved steps")
    for method, samples in interleaved_step_times(steps_by_method, steps=steps, device=device).items():
        results[method].step_samples = samples
    return list(results.values())
