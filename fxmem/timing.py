"""Timing a step: the one place fxmem times anything (benchmarks, the cost model's measured choices, tests)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


def step_times(step: Callable[[], object], *, steps: int, warmup: int = 1,
               device: torch.device | str = "cpu") -> list[float]:
    """Wall time of each of ``steps`` calls of ``step`` after ``warmup`` untimed ones."""
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    return times


def interleaved_step_times(steps_by_name: Mapping[str, Callable[[], object]], *, steps: int, warmup: int = 1,
                           device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """``step_times`` for several candidates, taken in rotating round-robin order.

    On a shared machine the speed drifts over minutes; timing the candidates
    one after another would put that drift into their ratios.
    """
    names = list(steps_by_name)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(warmup + steps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            [seconds] = step_times(steps_by_name[name], steps=1, warmup=0, device=device)
            if round_index >= warmup:
                samples[name].append(seconds)
    return samples


def warm_up_compiler() -> None:
    """Compile something trivial, so that inductor's one-time start-up (its compile workers) is charged to no
    candidate whose compile time is measured."""
    with torch.compiler.config.patch(force_disable_caches=True):
        torch.compile(lambda x: (x * 2).sin())(torch.randn(8))


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


@dataclass(frozen=True)
class Ratio:
    """A step-time ratio over interleaved rounds: the median of the per-round ratios and their range."""

    median: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"


def round_ratio(samples: Sequence[float], base: Sequence[float]) -> Ratio:
    """Per-round ``samples / base`` of two candidates timed in the same interleaved rounds."""
    ratios = [s / b for s, b in zip(samples, base, strict=True)]
    return Ratio(median(ratios), min(ratios), max(ratios))
