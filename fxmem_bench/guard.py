"""The guard's figures (docs/guard.md): settings that bend the gradient on purpose, and the presets as shipped, each
without and with the guard (worst LoRA-gradient cosine on the whole batch, saved bytes against eager's); and what
the guard costs a training run (step time amortized over its steps, and the peak of a step it checks before)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from fxmem.backend import Backend, compile_
from fxmem.config import Config
from fxmem.guard import GuardCheck, GuardedCall, check_plan
from fxmem.measure import (
    Fidelity,
    gradient_fidelity,
    model_tensors,
    peak_memory,
    saved_bytes_and_gradients,
)
from fxmem.peft_lora import prepare_peft
from fxmem_bench import coverage
from fxmem_bench.choices import GUARD_BENT_SETTINGS, GUARD_PRESETS
from fxmem_bench.workloads import Workload

# The bar for the bent settings: worst LoRA-gradient cosine >= 0.99 with the guard.
BENT_BOUND = 0.99


@dataclass(frozen=True)
class GuardedSetting:
    setting: str
    family: str
    preset: str
    dtype: str
    eager_bytes: int
    unguarded_bytes: int
    unguarded: Fidelity
    guarded_bytes: int
    guarded: Fidelity
    check: GuardCheck

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "family": self.family, "preset": self.preset, "dtype": self.dtype,
                "eager_bytes": self.eager_bytes, "unguarded_bytes": self.unguarded_bytes,
                "unguarded": self.unguarded.to_dict(), "guarded_bytes": self.guarded_bytes,
                "guarded": self.guarded.to_dict(), "check": self.check.to_dict()}


def settings(names: tuple[str, ...] = (*GUARD_BENT_SETTINGS, *GUARD_PRESETS), dtype: str = "fp32"
             ) -> list[GuardedSetting]:
    """Each setting (GUARD_BENT_SETTINGS at BENT_BOUND, or a preset as shipped on the tiny Llama) on its family's real-text
    batch: eager PEFT's saved bytes and gradients, then the plan unguarded, then the guard's check of it on the
    batch's slice and the mended plan, each compiled afresh and compared on the whole batch."""
    results = []
    for name in names:
        family, preset, overrides = GUARD_BENT_SETTINGS.get(name, ("llama", name, {}))
        overrides = {**overrides, "guard_cosine": BENT_BOUND} if name in GUARD_BENT_SETTINGS else overrides
        config = Config.from_preset(preset, **overrides)
        model, batch = coverage.build(coverage.get_family(family), dtype)
        exclude = model_tensors(model) + list(batch.values())

        def run(forward: Any, model: torch.nn.Module = model, batch: dict = batch, exclude: list = exclude
                ) -> tuple[int, dict[str, torch.Tensor]]:
            return saved_bytes_and_gradients(model, lambda: forward(**batch).loss, exclude)

        eager_bytes, reference = run(model)
        prepare_peft(model, config)
        torch._dynamo.reset()
        unguarded_bytes, unguarded = run(torch.compile(model, backend=Backend(config, lowering="eager")))
        demotions: dict[str, int] = {}
        check = check_plan(model, batch, config, demotions)
        torch._dynamo.reset()
        guarded_bytes, guarded = run(torch.compile(model, backend=Backend(config, lowering="eager",
                                                                          demotions=demotions)))
        torch._dynamo.reset()
        results.append(GuardedSetting(name, family, preset, dtype, eager_bytes, unguarded_bytes,
                                      gradient_fidelity(reference, unguarded), guarded_bytes,
                                      gradient_fidelity(reference, guarded), check))
    return results


@dataclass(frozen=True)
class GuardCost:
    workload: str
    preset: str
    steps: int
    every: int
    step_seconds: list[float]  # each guarded step, its check included where one ran (the first: the compiles too)
    unguarded_seconds: list[float]  # the unguarded model's steps after its first (its compile)
    checks: list[GuardCheck]
    peak_checked: int  # a step the guard checks before, its peak above its start
    peak_unguarded: int

    @property
    def first_check_seconds(self) -> float:
        return self.checks[0].seconds

    @property
    def recheck_seconds(self) -> float:
        """The median re-check (0 where none ran)."""
        return statistics.median([c.seconds for c in self.checks[1:]]) if len(self.checks) > 1 else 0.0

    @property
    def step_seconds_unguarded(self) -> float:
        return statistics.median(self.unguarded_seconds)

    def amortized(self, steps: int = 1000, every: int | None = None, *, first: bool = True) -> float:
        """The guard's checks over ``steps`` steps' time without them, re-checked every ``every`` (this run's by
        default): its first check included or (``first=False``) the re-checks alone."""
        every = every or self.every
        seconds = (self.first_check_seconds if first else 0.0) + (steps - 1) // every * self.recheck_seconds
        return seconds / (self.step_seconds_unguarded * steps)

    @property
    def unchecked_step_ratio(self) -> float:
        """The guarded model's median step without a check over the unguarded one's: the mended plan's own cost."""
        checked = {c.forward - 1 for c in self.checks}
        unchecked = [s for i, s in enumerate(self.step_seconds) if i not in checked]
        return statistics.median(unchecked) / self.step_seconds_unguarded

    def to_dict(self) -> dict[str, Any]:
        return {**{k: v for k, v in vars(self).items() if k != "checks"},
                "first_check_seconds": self.first_check_seconds, "recheck_seconds": self.recheck_seconds,
                "amortized_1000": self.amortized(), "rechecks_amortized_1000": self.amortized(first=False),
                "unchecked_step_ratio": self.unchecked_step_ratio, "checks": [c.to_dict() for c in self.checks]}


def cost(workload: Workload, preset: str = "hyclora-4bit", *, steps: int = 200, every: int = 100,
         unguarded_steps: int = 20, device: str = "cpu") -> GuardCost:
    """``steps`` AdamW steps of ``workload`` compiled by ``fxmem.compile_`` under ``preset``, the guard checking every
    ``every`` forwards, each step timed; the peak of a step the guard checks before against an unguarded step's; and
    ``unguarded_steps`` of the same model compiled without the guard."""
    def build(**options: Any) -> tuple[torch.nn.Module, Backend, Any]:
        torch._dynamo.reset()
        setup = workload.build(device=device)
        backend = compile_(setup.model, preset, **options)
        next(setup.batches)
        step, _ = setup.training_step(setup.model, next(setup.batches))
        return setup.model, backend, step

    model, backend, step = build(guard_every=every)
    step_seconds = [_timed(step, device) for _ in range(steps)]
    checks = list(backend.guard_checks)
    guarded: GuardedCall = model._compiled_call_impl
    guarded.last_check = guarded.forwards - every  # the next step is checked (its probed compile kept)
    peak_checked = peak_memory(step, device)
    _, _, unguarded_step = build(guard=False)
    _timed(unguarded_step, device)
    unguarded = [_timed(unguarded_step, device) for _ in range(unguarded_steps)]
    peak_unguarded = peak_memory(unguarded_step, device)
    return GuardCost(workload.name, preset, steps, every, step_seconds, unguarded, checks, peak_checked,
                     peak_unguarded)


def _timed(step: Any, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start
