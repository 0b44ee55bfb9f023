"""Fidelity probes: a compressed saved tensor read back in backward either as restored or exactly, switched at run
time, so that one compiled region measures what each compressed tensor alone does to the gradients
(fxmem.check_fidelity). Only a backend built with ``fidelity_probes=True`` inserts them; it then also saves every
compressed tensor exactly, beside its compressed form.

The switches are Python state, read by an opaque custom op when backward runs: changing them needs no recompile.
"""

from __future__ import annotations

import itertools

import torch

# probe id -> read the restored (compressed) value; False reads the exact copy. Ids are never reused.
COMPRESSED: dict[int, bool] = {}
_NEXT_ID = itertools.count()


def register() -> int:
    """A new probe, reading its compressed value."""
    probe = next(_NEXT_ID)
    COMPRESSED[probe] = True
    return probe


def release(probes: list[int]) -> None:
    for probe in probes:
        COMPRESSED.pop(probe, None)


# Its switch is Python state, which a CUDA graph replay would skip: the tag keeps it out of what inductor captures.
@torch.library.custom_op("fxmem::fidelity_probe", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def fidelity_probe(restored: torch.Tensor, exact: torch.Tensor, probe: int) -> torch.Tensor:
    """``restored`` while probe ``probe`` is switched to its compressed value, else ``exact``: a copy (a custom
    op's output may not alias its inputs) laid out as ``restored``, as the fake says."""
    chosen = restored if COMPRESSED.get(probe, True) else exact
    return torch.empty_like(restored).copy_(chosen)


@fidelity_probe.register_fake
def _(restored, exact, probe):
    return torch.empty_like(restored)
