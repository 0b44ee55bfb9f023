"""Static calibration of saved-tensor quantization: statistics over whole batches, then frozen scales.

HyC-LoRA (section 4.1-4.2) calibrates: for the first ``calibration_steps``
training forwards it gathers per-channel statistics over the whole batch, then
freezes the per-channel scales and the outlier channels (the top
``outlier_ratio`` channels by L2 norm) for the rest of training ("static"; values
outside the calibrated range are clamped). fxmem's default, "dynamic", takes both
from every batch inside the compiled graph and needs no state at all. Fine-tuning
moves activations past the calibrated ranges within a few steps: clamping then
made the gradients diverge and the loss end above the uncompressed run's, and
widening the frozen ranges instead kept the loss but let the gradient error grow
as the ranges only grew (measured: docs/quantization.md).

Each statically calibrated saved tensor has a ``QuantSlot``. The compiled forward
computes the batch's per-channel statistics (fused by inductor with the tensor's
producer) and calls ``fxmem::calibrated_params(low, high, square_norm, slot)``, a
small op on per-channel vectors that updates the slot and returns the scales,
zero points and outlier channel ids to use, as fresh tensors, so the backward
dequantizes with exactly those even if the slot moves on.

Under data parallelism each rank calibrates on its own part of the batch. Reducing
the statistics across ranks reproduces one process better (docs/history/benchmarks-2026-11-26.md,
"DDP and FSDP2"), but a collective in the forward needs every rank to make the
same calls at the same step, and a rank that recompiles later than another (a new
sequence length) starts new slots calibrating while the other's are frozen: its
collective would pair with DDP's gradient all-reduce.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fxmem.kernels.quantize import quant_params

_NEXT_ID = itertools.count()


@dataclass
class QuantSlot:
    """One saved tensor's quantization state; channels are the tensor's last dimension."""

    name: str
    channels: int
    bits: int
    outliers: int  # number of outlier channels kept in full precision
    calibration_steps: int
    seen: int = 0  # training forwards observed
    low: torch.Tensor | None = field(default=None, repr=False)
    high: torch.Tensor | None = field(default=None, repr=False)
    square_norm: torch.Tensor | None = field(default=None, repr=False)
    frozen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    id: int = field(default_factory=lambda: next(_NEXT_ID))  # its key in SLOTS once registered

    @property
    def calibrated(self) -> bool:
        return self.frozen is not None

    def observe(self, low: torch.Tensor, high: torch.Tensor, square_norm: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, zero, outlier channel ids) for a batch with these per-channel statistics, after adding them to
        the calibration's while it lasts."""
        self.seen += 1
        if self.frozen is not None:
            return self.frozen
        if self.low is None:  # copies: inductor reuses its buffers once the op returns
            self.low, self.high, self.square_norm = low.clone(), high.clone(), square_norm.clone()
        else:
            self.low = torch.minimum(self.low, low)
            self.high = torch.maximum(self.high, high)
            self.square_norm = self.square_norm + square_norm
        scale, zero = quant_params(self.low, self.high, self.bits)
        ids = torch.topk(self.square_norm, self.outliers).indices.sort().values
        params = (scale, zero, ids)
        if self.seen >= self.calibration_steps:
            self.frozen = params
            self.low = self.high = self.square_norm = None
        return params

    def to_dict(self) -> dict:
        ids = self.frozen[2].tolist() if self.frozen is not None else None
        return {"name": self.name, "bits": self.bits, "channels": self.channels, "outliers": self.outliers,
                "seen": self.seen, "calibrated": self.calibrated, "outlier_channels": ids}


# slot id -> slot. Compiled code finds its slots by the ids baked into it; the backend releases them when that code
# is freed (fxmem/backend.py). Ids are never reused: a graph that still names a released id names no other slot.
SLOTS: dict[int, QuantSlot] = {}


def register(slot: QuantSlot) -> int:
    """Make ``slot`` findable by its id, the one compiled code passes to ``calibrated_params``."""
    SLOTS[slot.id] = slot
    return slot.id


def release(slots: Iterable[QuantSlot]) -> None:
    for slot in slots:
        SLOTS.pop(slot.id, None)


# Its state is Python, which a CUDA graph replay would skip: the tag keeps it out of what inductor captures.
@torch.library.custom_op("fxmem::calibrated_params", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def calibrated_params(low: torch.Tensor, high: torch.Tensor, square_norm: torch.Tensor, slot: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scale, zero, outlier channel ids) of slot ``slot`` for a batch with these per-channel statistics."""
    # Fresh copies: what backward reads must not change when the slot does.
    return tuple(t.clone() for t in SLOTS[slot].observe(low, high, square_norm))


@calibrated_params.register_fake
def _(low, high, square_norm, slot):
    return torch.empty_like(low), torch.empty_like(low), low.new_empty(SLOTS[slot].outliers, dtype=torch.long)
