"""The longest length that fits a memory cap: one search for `fxmem whatif --max-context`'s predictions and
`fxmem bench context`'s measurements.

Each probe (a trace or a real step) costs seconds to minutes, so the search places few: it uses that a step's peak
grows about linearly in the length (no length-squared attention scores on a CPU or a GPU), and brackets the answer
whatever the peaks do.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

MAX_PROBES = 12  # the search stops here and reports its bracket as it stands, marked unconverged
MAX_GROWTH = 4  # no probe beyond this many times the longest length found to fit (the start, before any fits)


@dataclass(frozen=True)
class Probe:
    """One length, measured or predicted: the step's peak above the static bytes, and the static bytes.
    ``out_of_memory``: the device ran out before the step ended, so ``peak_bytes`` says nothing."""

    seq: int
    peak_bytes: int
    static_bytes: int
    out_of_memory: bool = False

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.static_bytes

    def fits(self, memory_cap: int) -> bool:
        return not self.out_of_memory and self.total_bytes <= memory_cap


@dataclass(frozen=True)
class Fit:
    longest: int  # the longest length measured to fit (0: none)
    shortest_failing: int | None  # the shortest measured not to (None: none measured)
    probes: list[Probe]
    converged: bool  # the two are one granularity apart, or the longest is the largest allowed


def longest_fitting(measure: Callable[[int], Probe], memory_cap: int, *, start: int, granularity: int,
                    max_seq: int) -> Fit:
    """The longest multiple of ``granularity`` up to ``max_seq`` whose probe fits ``memory_cap``, searched from
    ``start``.

    The next length is where the line through the last two probes (through the origin of the step's peak, from
    one probe) meets the cap. Until a length fails, each probe goes past the longest fitting length by at least
    ``granularity``, doubled at every probe, and by no more than MAX_GROWTH times it. Once a length has failed,
    predictions are kept strictly inside the bracket, and after a probe that did not halve it the next one
    bisects it. If the peaks fall as the length grows, the answer is only the longest found.
    """
    if granularity < 1 or start < granularity or start % granularity:
        raise ValueError(f"start ({start}) must be a positive multiple of granularity ({granularity})")
    max_seq -= max_seq % granularity
    if max_seq < start:
        raise ValueError(f"max_seq, rounded down to a multiple of granularity ({max_seq}), is below start ({start})")
    probes: list[Probe] = []
    fits, fails = 0, None
    seq, stride, width = start, granularity, None
    while len(probes) < MAX_PROBES:
        probe = measure(seq)
        probes.append(probe)
        if probe.fits(memory_cap):
            fits = max(fits, seq)
        else:
            fails = seq if fails is None else min(fails, seq)
        lower, upper = fits + granularity, min(fails - granularity if fails is not None else max_seq, max_seq)
        if lower > upper:
            break
        predicted = _where_cap_met([p for p in probes if not p.out_of_memory], memory_cap, granularity)
        if fails is None:  # each step past the longest fitting length at least twice the one before
            seq = min(max(predicted or 0, fits + stride), upper, MAX_GROWTH * max(fits, start))
            stride *= 2
            continue
        halved = width is None or fails - fits <= width / 2
        width = fails - fits
        if predicted is None or not halved:
            predicted = fits + (width // 2) // granularity * granularity
        seq = max(lower, min(predicted, upper))
    converged = fits == max_seq or (fails is not None and fails - fits == granularity)
    return Fit(fits, fails, probes, converged)


def _where_cap_met(probes: list[Probe], memory_cap: int, granularity: int) -> int | None:
    """The length, rounded down to ``granularity``, at which the last two probes' line reaches the cap (None: no
    probe, or a line that does not rise)."""
    if not probes:
        return None
    last = probes[-1]
    if len(probes) == 1:
        slope = last.peak_bytes / last.seq  # the step's peak through the origin
        intercept = last.static_bytes
    else:
        before = probes[-2]
        slope = (last.total_bytes - before.total_bytes) / (last.seq - before.seq)
        intercept = last.total_bytes - slope * last.seq
    if slope <= 0:
        return None
    return max(granularity, math.floor((memory_cap - intercept) / slope / granularity) * granularity)
