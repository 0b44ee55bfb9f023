"""Runtime quantization state of saved tensors: calibration statistics, then frozen scales.

HyC-LoRA (section 4.1-4.2) calibrates: for the first ``calibration_steps``
training forwards it gathers per-channel statistics over the whole batch, then
freezes the per-channel scales and the outlier channels (the top
``outlier_ratio`` channels by L2 norm) for the rest of training ("static"; values
outside the calibrated range are clamped). "dynamic" (the default) recomputes
both from every batch. Fine-tuning moves activations: on llama-tiny at lr 1e-3
they left the calibrated range by 20-50% two steps after calibration, clamping
made the gradients diverge, and the loss ended 10% above the uncompressed run's;
widening the frozen ranges instead kept the loss but let the gradient error grow
from 3% to 18% over 200 steps as the ranges only grew.

Each quantized saved tensor has a ``QuantSlot``. The compiled forward calls
``fxmem::quantize_saved(x, slot)``, an op that reads and updates the slot and
returns the packed codes together with the scales and outlier ids it used, so
the backward dequantizes with exactly those even if the slot moves on (several
forwards before one backward, dynamic mode). With ``outlier_values`` the op first
takes the outlier values out (fxmem.kernels.quantize.split_outlier_values), so
that the statistics, the scales and the codes are the rest's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxmem.kernels.quantize import outlier_value_count, quant_params, split_outlier_values


@dataclass
class QuantSlot:
    """One saved tensor's quantization state; channels are the tensor's last dimension."""

    name: str
    channels: int
    bits: int
    outliers: int  # number of outlier channels kept in full precision
    outlier_values: float  # fraction of the values kept exact (Config.outlier_values), 0 for none
    calibration_steps: int
    mode: str  # static | dynamic (Config.calibration)
    seen: int = 0  # training forwards observed
    low: torch.Tensor | None = field(default=None, repr=False)
    high: torch.Tensor | None = field(default=None, repr=False)
    square_norm: torch.Tensor | None = field(default=None, repr=False)
    frozen: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def calibrated(self) -> bool:
        return self.frozen is not None

    def observe(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, zero, outlier channel ids) for quantizing ``x``, updating the statistics first."""
        self.seen += 1
        if self.frozen is not None:
            return self.frozen
        low, high, square_norm = _channel_stats(x.reshape(-1, self.channels))
        if self.mode == "dynamic" or self.low is None:
            self.low, self.high, self.square_norm = low, high, square_norm
        else:
            self.low = torch.minimum(self.low, low)
            self.high = torch.maximum(self.high, high)
            self.square_norm = self.square_norm + square_norm
        scale, zero = quant_params(self.low, self.high, self.bits)
        ids = torch.topk(self.square_norm, self.outliers).indices.sort().values
        params = (scale, zero, ids)
        if self.mode == "static" and self.seen >= self.calibration_steps:
            self.frozen = params
            self.low = self.high = self.square_norm = None
        return params

    def to_dict(self) -> dict:
        ids = self.frozen[2].tolist() if self.frozen is not None else None
        return {"name": self.name, "bits": self.bits, "channels": self.channels, "outliers": self.outliers,
                "seen": self.seen, "calibrated": self.calibrated, "outlier_channels": ids}


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel min, max and squared L2 norm of a (rows, channels) tensor.

    Non-finite values count as 0: one temporary, no host synchronisation.
    """
    x = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    low, high = torch.aminmax(x, dim=0)
    square_norm = torch.linalg.vector_norm(x, dim=0, dtype=torch.float32).square()
    return low.float(), high.float(), square_norm


# Slots are found by index from compiled code; a slot lives as long as the process (a few per saved tensor).
SLOTS: list[QuantSlot] = []


def register(slot: QuantSlot) -> int:
    SLOTS.append(slot)
    return len(SLOTS) - 1


@torch.library.custom_op("fxmem::quantize_saved", mutates_args=())
def quantize_saved(x: torch.Tensor, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                         torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed, outliers, scale, zero, outlier ids, outlier value positions, outlier values) of ``x`` under slot
    ``slot``'s current parameters."""
    state = SLOTS[slot]
    x = x.contiguous()
    count = outlier_value_count(x.numel(), state.outlier_values)
    if count:
        x, positions, values = split_outlier_values(x, count)
    else:
        positions, values = x.new_empty(0, dtype=torch.int32), x.new_empty(0)
    scale, zero, ids = state.observe(x)
    packed, outliers = torch.ops.fxmem.quantize(x, scale, zero, ids, state.bits)
    # Fresh copies: what backward reads must not change when the slot does.
    return packed, outliers, scale.clone(), zero.clone(), ids.clone(), positions, values


@quantize_saved.register_fake
def _(x, slot):
    state = SLOTS[slot]
    packed, outliers = torch.ops.fxmem.quantize(
        x, x.new_empty(state.channels, dtype=torch.float32), x.new_empty(state.channels, dtype=torch.float32),
        x.new_empty(state.outliers, dtype=torch.long), state.bits)
    scale = x.new_empty(state.channels, dtype=torch.float32)
    count = outlier_value_count(x.numel(), state.outlier_values)
    return (packed, outliers, scale, torch.empty_like(scale), x.new_empty(state.outliers, dtype=torch.long),
            x.new_empty(count, dtype=torch.int32), x.new_empty(count))
