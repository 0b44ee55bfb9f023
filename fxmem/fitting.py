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

MAX_PROBES = 12  # the search stops here and reports its bracket as it stands


@dataclass(frozen=True)
class Probe:
    """One length, measured or predicted: the step's peak above the static bytes, and the static bytes."""

    seq: int
    peak_bytes: int
    static_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.static_bytes


def longest_fitting(measure: Callable[[int], Probe], memory_cap: int, *, start: int, granularity: int,
                    max_seq: int) -> tuple[int, int | None, list[Probe]]:
    """The longest multiple of ``granularity`` up to ``max_seq`` whose probe fits ``memory_cap``, the shortest
    measured that does not, and every probe, in order.

    The next length is where the line through the last two probes (through the origin of the step's peak, from
    one probe) meets the cap, kept strictly inside the bracket found so far; a prediction at or below the longest
    fitting length steps past it by ``granularity``, doubling the step each time it is wrong again.
    """
    if start % granularity or max_seq < start:
        raise ValueError(f"start ({start}) must be a multiple of granularity ({granularity}) and at most "
                         f"max_seq ({max_seq})")
    probes: list[Probe] = []
    fits, fails = 0, None
    seq, stride = start, granularity
    while len(probes) < MAX_PROBES:
        probe = measure(seq)
        probes.append(probe)
        if probe.total_bytes <= memory_cap:
            fits = max(fits, seq)
        else:
            fails = seq if fails is None else min(fails, seq)
        upper = min(fails - granularity if fails is not None else max_seq, max_seq)
        if upper <= fits:
            break
        predicted = _where_cap_met(probes, memory_cap, granularity)
        if predicted <= fits:
            predicted, stride = fits + stride, stride * 2
        else:
            stride = granularity
        lower = fits + granularity if fits else granularity
        seq = max(lower, min(predicted, upper))
        if any(p.seq == seq for p in probes):  # only when the bracket has closed to one untried length
            break
    return fits, fails, probes


def _where_cap_met(probes: list[Probe], memory_cap: int, granularity: int) -> int:
    """The length, rounded down to ``granularity``, at which the last two probes' line reaches the cap."""
    last = probes[-1]
    if len(probes) == 1 or probes[-2].seq == last.seq:
        slope = last.peak_bytes / last.seq  # the step's peak through the origin
        intercept = last.static_bytes
    else:
        before = probes[-2]
        slope = (last.total_bytes - before.total_bytes) / (last.seq - before.seq)
        intercept = last.total_bytes - slope * last.seq
    if slope <= 0:
        return last.seq * 2
    return max(granularity, math.floor((memory_cap - intercept) / slope / granularity) * granularity)
