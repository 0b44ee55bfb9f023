"""The one solver: which option each unit (a saved storage, or a block) takes. It reads plain numbers only (bytes
freed, seconds added, an error class), as torch's budget solvers read lists of memory and runtime
(torch/_functorch/_activation_checkpointing/knapsack.py); the planner reads the graph, prices the options and applies
the chosen ones. One rule orders every option, against either target:

- ``Ceilings``, a preset's: each unit's own least saving (the bytes of the compression the config asks of it);
  every unit takes its best option that frees at least that, else the one that frees the most;
- ``Budget``, memory_budget's: the region's bytes down to one target; from each unit's plan now, the best move of
  all is taken, one at a time, until the region fits or no move frees bytes.

The rule (``option_key``): the least error class, then the fewest seconds per byte freed, then the most bytes freed.
A chosen option can change other units' options (a source raised, a table paid for, a storage a recomputation reads
moved): ``apply`` names them, and they are priced again.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fxmem.cost_model.plan import Plan, RaisedFor


@dataclass(frozen=True)
class Option:
    """One way to hold a unit between forward and backward, with its effects.

    ``saves`` and ``seconds`` are measured against the unit's reference: its exact state under Ceilings (what
    the option costs in all), its plan now under Budget (what moving to it costs)."""

    unit: str
    saves: int  # device bytes freed
    seconds: float  # seconds added to the step
    error: int  # error class (cost_model/error.py): 0 is exact
    plans: Mapping[str, Plan] = field(default_factory=dict)  # the plan it gives each storage it moves
    raises: tuple[tuple[str, RaisedFor], ...] = ()  # storages backward then rebuilds from, and what it rebuilds
    tables: frozenset[str] = frozenset()  # RoPE tables it pays for, saved once for the region
    added: Mapping[str, int] = field(default_factory=dict)  # storages it saves that nothing saved (a block's sources)


@dataclass(frozen=True)
class Ceilings:
    """A preset's target: the fewest bytes each unit must free."""

    least_saves: Mapping[str, int]


@dataclass(frozen=True)
class Budget:
    """memory_budget's target: the region's bytes, from ``total`` now, down to ``target``."""

    total: int
    target: float


def option_key(option: Option) -> tuple[int, float, int]:
    """The one order of options: the least error class, the fewest seconds per byte freed, the most bytes freed."""
    per_byte = option.seconds / option.saves if option.saves > 0 else math.inf
    return option.error, per_byte, -option.saves


def solve(target: Ceilings | Budget, units: Sequence[str], price: Callable[[str], list[Option]],
          apply: Callable[[Option], Iterable[str]]) -> None:
    """Chooses options until ``target`` holds or nothing is left to choose. ``units`` in the order ties are broken
    (the graph's); ``price(unit)``: the unit's options now; ``apply(option)``: takes it, and returns the units whose
    options it changed. Under Ceilings returns once no unit's choice changes; under Budget once the region fits or
    no option frees bytes."""
    if isinstance(target, Ceilings):
        _fit_each(target, units, price, apply)
    elif isinstance(target, Budget):
        _fit_total(target, units, price, apply)
    else:
        raise TypeError(f"target must be Ceilings or Budget, not {type(target).__name__}")


def _fit_each(target: Ceilings, units: Sequence[str], price: Callable[[str], list[Option]],
              apply: Callable[[Option], Iterable[str]]) -> None:
    position = {unit: index for index, unit in enumerate(units)}
    pending = list(units)
    while pending:
        unit = pending.pop(0)
        options = price(unit)
        if not options:
            continue
        within = [o for o in options if o.saves >= target.least_saves[unit]]
        chosen = min(within, key=option_key) if within else max(options, key=lambda o: o.saves)
        pending.extend(sorted(apply(chosen), key=position.__getitem__))


def _fit_total(target: Budget, units: Sequence[str], price: Callable[[str], list[Option]],
               apply: Callable[[Option], Iterable[str]]) -> None:
    position = {unit: index for index, unit in enumerate(units)}
    heap: list[tuple[tuple[int, float, int], int, Option]] = []
    counter = 0

    def best(unit: str) -> Option | None:
        return min((o for o in price(unit) if o.saves > 0), key=option_key, default=None)

    def push(pushed: Iterable[str]) -> None:
        nonlocal counter
        # in the units' order: equal keys then pop by it, not by a set's (hash-seeded) order
        for unit in sorted(pushed, key=position.__getitem__):
            option = best(unit)
            if option is not None:
                heapq.heappush(heap, (option_key(option), counter, option))
                counter += 1

    total = target.total
    push(units)
    while total > target.target and heap:
        _, _, option = heapq.heappop(heap)
        fresh = best(option.unit)
        if fresh is None:
            continue
        if fresh != option:  # another move changed what this one reads: priced again
            push([option.unit])
            continue
        total -= option.saves
        push(apply(option))
