"""The options set to "auto", turned on where the step's predicted peak drops: ``mlp_chunk``, ``norm_chunk``,
``linear_chunk`` (chunked transients) and ``block_checkpoint``.

A chunked op (passes/dynamo/chunk_mlp.py, chunk_norm.py, chunk_linears.py) holds one chunk of its wide tensors at a time
and saves only its input, for its products run again in backward; a checkpointed block (passes/joint/checkpoint_blocks.py)
saves only its input, for its forward run again in backward, where backward then holds its activations whole. Each
pays where what it cuts sets the step's peak, which depends on everything else the step holds: at long context the
transients dominate, at short context and under an exact plan the saved tensors may. So the choice is the region's,
priced by the liveness model whatif uses (analysis/liveness.py, as inductor runs the graphs): the region is planned
with every set of the "auto" groups on (the chunk options one group, block_checkpoint another), and each set, the
fewest on first, replaces the one chosen so far where it lowers the predicted peak of activations (saved plus
transients) by at least ``MIN_PEAK_CUT``. Under dynamic shapes the choice and the chunks' tokens are made at the
traced length's hint, and kept for every length the graph then runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fxmem.choices import AUTO, CHUNK_OPTIONS
from fxmem.cost_model.memory import planned_bytes

if TYPE_CHECKING:
    from fxmem.analysis import SavedRecord
    from fxmem.config import Config
    from fxmem.cost_model.plan import Plan

# Under "auto" one chunk holds no more bytes than the op's input (the kernels' workspace_bytes, per row): the step
# holds that input anyway, and mini-sequence training's split of an MLP into its width over the hidden size rests on
# the same measure. Within these rows: fewer leave a product below its rate (a GPU's matmul tiles are 128 rows), and
# more hold more bytes for no faster product (2048: whatif's Llama-3-8B figures; not measured against other sizes
# on a GPU).
MIN_AUTO_ROWS = 128
MAX_AUTO_ROWS = 2048
# The least cut of the predicted peak worth the chunked ops' products again: the liveness model is close to measured
# steps with chunks and well below them without (measured: docs/long-context.md), so a smaller predicted cut is within
# its error.
MIN_PEAK_CUT = 0.10


def chunk_rows(setting: int | str, rows: int, input_row_bytes: int, workspace_row_bytes: Callable[[bool], int]
               ) -> int:
    """The tokens per chunk of an op over ``rows`` tokens: ``setting`` itself, or under "auto" as many as hold no
    more workspace than its input (``input_row_bytes`` a token), within ``MIN_AUTO_ROWS`` and ``MAX_AUTO_ROWS`` and
    no more than ``rows``. ``workspace_row_bytes(backward)``: the op's workspace a token, in forward or backward."""
    if setting != AUTO:
        return int(setting)
    workspace = max(workspace_row_bytes(False), workspace_row_bytes(True))
    fits = rows * input_row_bytes // max(1, workspace)
    return max(1, min(rows, MAX_AUTO_ROWS, max(MIN_AUTO_ROWS, fits)))


def predicted_peak_bytes(saved: Iterable[SavedRecord], plans: Iterable[Plan], transient: int) -> int:
    """What a planned region's step holds at its peak beside its weights and inputs: the bytes its plans save for its
    saved tensors, and ``transient``, its graphs' transients as inductor runs them (Region.compiled_transient_bytes).
    """
    return transient + sum(planned_bytes(s, p) for s, p in zip(saved, plans, strict=True) if s.frees_memory)


def lowers_peak(off: int, on: int) -> bool:
    """Whether a region with an "auto" group on, predicted to peak at ``on`` bytes, is worth its time over the region
    with it off, predicted to peak at ``off``."""
    return 0 < off and on <= off * (1 - MIN_PEAK_CUT)


@dataclass(frozen=True)
class AutoGroup:
    """Options set to "auto" that are turned on or off together, and the word the report uses for "on"."""

    names: tuple[str, ...]
    on: dict[str, Any]  # the options' values when on
    off: dict[str, Any]
    word: str

    @property
    def label(self) -> str:
        return ", ".join(f"{name}={AUTO}" for name in self.names)

    def note(self, chosen: bool, on_peak: int, off_peak: int) -> str:
        """The report's note on the choice: the predicted peaks with the group on and off, the other groups as
        chosen."""
        return (f"{self.label}: {self.word if chosen else 'not ' + self.word}, the step's activations predicted to "
                f"peak at {_size(on_peak)} {self.word} and {_size(off_peak)} not ({self.word} where "
                f"{MIN_PEAK_CUT:.0%} lower)")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def auto_groups(config: Config) -> list[AutoGroup]:
    """``config``'s "auto" options, each group in the order ``choose_auto`` tries them: chunks first, since they cut
    the transients that a checkpointed block, recomputed in backward, holds whole."""
    groups = []
    chunks = tuple(name for name in config.auto_options() if name in CHUNK_OPTIONS)
    if chunks:
        groups.append(AutoGroup(chunks, dict.fromkeys(chunks, AUTO), dict.fromkeys(chunks), "chunked"))
    if "block_checkpoint" in config.auto_options():
        # the block options that need block_checkpoint go with it
        groups.append(AutoGroup(("block_checkpoint",), {"block_checkpoint": True, "block_input_bits":
                                config.block_input_bits, "block_offload": config.block_offload},
                                {"block_checkpoint": False, "block_input_bits": None, "block_offload": False},
                                "checkpointed"))
    return groups


@dataclass(frozen=True)
class AutoChoice:
    config: Config  # every "auto" option turned on or off
    notes: list[str]  # the report's, one per group
    failure: str | None = None  # why every group was left off: a prediction failed


def choose_auto(config: Config, predict: Callable[[Config], int | str | None]) -> AutoChoice:
    """``config`` with each group of its "auto" options on or off. ``predict`` gives a config's predicted peak of
    activations (None: it does not train; a string: why it could not be predicted) for every set of groups on; each
    set, the fewest on first, replaces the one chosen so far where ``lowers_peak``. Every set is predicted: a group
    may pay only with another on (a checkpointed block, recomputed whole, holds transients that only chunks cut)."""
    groups = auto_groups(config)

    def applied(on: frozenset[int]) -> Config:  # the groups on, by index
        return config.replace(**{name: value for index, group in enumerate(groups)
                                 for name, value in (group.on if index in on else group.off).items()})

    sets = [frozenset(c) for size in range(len(groups) + 1) for c in itertools.combinations(range(len(groups)), size)]
    peaks: dict[frozenset[int], int] = {}
    for on in sets:
        peak = predict(applied(on))
        if peak is None or isinstance(peak, str):
            why = ("the region does not train (no backward)" if peak is None
                   else f"the step could not be predicted ({peak})")
            notes = [f"{group.label}: not {group.word}, {why}" for group in groups]
            return AutoChoice(applied(frozenset()), notes, None if peak is None else notes[0])
        peaks[on] = peak
    chosen = sets[0]
    for on in sets[1:]:
        if lowers_peak(peaks[chosen], peaks[on]):
            chosen = on
    notes = [group.note(index in chosen, peaks[chosen | {index}], peaks[chosen - {index}])
             for index, group in enumerate(groups)]
    return AutoChoice(applied(chosen), notes)
