"""Chunked transients chosen by the step's predicted peak: ``mlp_chunk``, ``norm_chunk`` and ``linear_chunk`` set
to "auto".

A chunked op (passes/chunk_mlp.py, chunk_norm.py, chunk_linears.py) holds one chunk of its wide tensors at a time
and saves only its input, for its products run again in backward. It pays where those tensors set the step's peak,
which depends on everything else the step holds: at long context the transients dominate, at short context and
under an exact plan the saved tensors may. So the choice is the region's, priced by the liveness model whatif uses
(analysis/liveness.py, as inductor runs the graphs): the region is planned whole and chunked, and chunked where
that lowers its predicted peak of activations (saved plus transients) by at least ``MIN_PEAK_CUT``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxmem.choices import CHUNK_AUTO
from fxmem.cost_model.memory import planned_bytes

if TYPE_CHECKING:
    from fxmem.region import Region

# Under "auto" one chunk holds no more bytes than the op's input (the kernels' workspace_bytes, per row): the step
# holds that input anyway, and mini-sequence training's split of an MLP into its width over the hidden size rests on
# the same measure. Within these rows: fewer leave a product below its rate (a GPU's matmul tiles are 128 rows), and
# more hold more bytes for no faster product (2048: whatif's Llama-3-8B figures; not measured against other sizes
# on a GPU).
MIN_AUTO_ROWS = 128
MAX_AUTO_ROWS = 2048
# The least cut of the predicted peak worth the chunked ops' products again: the liveness model was within a few
# percent of measured steps with chunks, and 1.29x below one without (docs/long-context.md), so a smaller predicted
# cut is within its error.
MIN_PEAK_CUT = 0.10


def chunk_rows(setting: int | str, rows: int, input_row_bytes: int, workspace_row_bytes: int) -> int:
    """The tokens per chunk of an op over ``rows`` tokens: ``setting`` itself, or under "auto" as many as hold no
    more workspace (``workspace_row_bytes`` a token) than its input (``input_row_bytes`` a token), within
    ``MIN_AUTO_ROWS`` and ``MAX_AUTO_ROWS`` and no more than ``rows``."""
    if setting != CHUNK_AUTO:
        return int(setting)
    fits = rows * input_row_bytes // max(1, workspace_row_bytes)
    return max(1, min(rows, MAX_AUTO_ROWS, max(MIN_AUTO_ROWS, fits)))


def predicted_peak_bytes(region: Region) -> int:
    """What a planned region's step holds at its peak beside its weights and inputs: the bytes its plan saves and
    the transients of its graphs as inductor runs them (Region.compiled_transient_bytes)."""
    saved = sum(planned_bytes(s, p) for s, p in zip(region.saved, region.plans, strict=True) if s.frees_memory)
    return saved + region.compiled_transient_bytes


def chunking_pays(whole: int, chunked: int) -> bool:
    """Whether a region chunked, predicted to peak at ``chunked`` bytes, is worth running over one whose predicted
    peak is ``whole``."""
    return 0 < whole and chunked <= whole * (1 - MIN_PEAK_CUT)
