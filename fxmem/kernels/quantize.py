"""Per-channel quantization of a saved activation with real bit packing, outlier channels and outlier values.

Written as plain torch ops: the quantize pass traces ``quantize`` into the forward graph right after the op
that produces the saved tensor and ``dequantize`` into the backward graph right before the op that reads it
back, and inductor generates each inside the kernels around it (C++ on the CPU, Triton on CUDA). Run eagerly,
the same functions are the torch reference the compiled code is tested against.

The math is HyC-LoRA's equations (1)-(2): per channel (the tensor's last, contiguous dimension) a scale s and
an integer zero point; a value x is stored as the unsigned code ``clamp(floor(x / s + zero + 1/2), 0, 2**bits
- 1)`` and read back as ``(code - zero) * s``. ``zero`` is the paper's z shifted by 2**(bits-1), so codes are
unsigned, and rounds the channel's minimum onto the grid.

Codes are packed in planes along each row: a row of C channels takes W = ceil(C * bits / 8) bytes, and its
byte j holds the codes of channels j, j + W, j + 2 W, ... (8 // bits of them, the first in the lowest bits). Each
plane is a contiguous run of channels, so packing reads every channel at an affine offset and unpacking writes
one: inductor vectorizes both (an interleaved layout, channels 2j and 2j + 1 in byte j, made it index by j // 2
and j % 2, and its C++ fell back to scalar loops: 10-40x slower packing, 2x slower unpacking). The arithmetic is
in float32, exact for bytes: a shift by a constant is a multiplication by a power of two, which vectorizes where
inductor's uint8 shifts do not. The fused LoRA epilogue kernels (fxmem/kernels/lora_epilogue.py) read the same
layout.

Outlier channels (``outliers``): the channels with the largest L2 norm, kept in full precision beside the
codes and written back over theirs. Outlier values (``chunk``): of each row, the value of each chunk of
``chunk`` channels farthest from its channel's mean in channel standard deviations is kept exactly, with its
index in the chunk as one byte; the channel's range is then its mean +- ``SPREAD`` standard deviations (within
its minimum and maximum), so the rest gets a finer grid, and a value outside it that no chunk kept is clamped to
it. The selection has a fixed shape: no data-dependent size, no host synchronisation.

Statistics treat non-finite values as 0; a NaN is stored as the zero code, an infinity as the end code, and
non-finite values count as the farthest of all, so an outlier value keeps one exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BITS_CHOICES = (1, 2, 4, 8)  # the widths the packing supports: 8 // bits codes to a byte
# With outlier values, a channel's grid spans its mean +- SPREAD standard deviations. The chunks' exact values
# take the tails: 3 leaves about 0.3% of a Gaussian channel outside, a fifth of a value a 64-channel chunk. At 2
# bits 3 beat 2.5 and 2 (median LoRA-gradient error 6.6% against 7.4% and 9.2% on llama-tiny after 5 steps).
SPREAD = 3.0


def check_bits(bits: int) -> None:
    if bits not in BITS_CHOICES:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS_CHOICES))}; got {bits!r}")


def packed_width(channels: int, bits: int) -> int:
    """Bytes one row of ``channels`` codes of ``bits`` bits takes once packed."""
    return (channels * bits + 7) // 8


def outlier_chunk(ratio: float) -> int:
    """The chunk of channels that keeps one outlier value per row for ``ratio`` (Config.outlier_values): the power
    of two nearest 1 / ratio, so that the index in the chunk is a byte; 0 for none."""
    if ratio <= 0:
        return 0
    return min(128, 2 ** max(0, round(math.log2(1 / ratio))))


@dataclass(frozen=True)
class QuantSpec:
    """How one saved tensor is stored: the channels (its last dimension), the bits of its codes, its outlier
    channels and the chunk of channels that keeps one outlier value per row (0: none)."""

    channels: int
    bits: int
    outliers: int = 0
    chunk: int = 0

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.chunk and (self.chunk & (self.chunk - 1) or self.chunk > 256):
            raise ValueError(f"chunk must be a power of two up to 256 (its index is a byte); got {self.chunk}")


def quant_params(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, zero) from per-channel min and max, as equation (1). A constant channel (max == min)
    gets the scale |value| (1 for zero) and a zero point that reproduces the value exactly."""
    check_bits(bits)
    low, high = torch.minimum(low, high), torch.maximum(low, high)
    scale = (high - low) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.where(high != 0, high.abs(), 1.0))
    return scale, -torch.round(low / scale)


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per channel (last dimension) over every other, in float32, non-finite values as 0: (min, max, mean,
    standard deviation, squared L2 norm). One pass: inductor computes the five in one loop."""
    finite = x.float()
    finite = torch.where(finite.abs() < float("inf"), finite, 0.0)  # abs() < inf vectorizes; isnan does not
    dims = tuple(range(x.dim() - 1))
    count = finite.numel() // x.shape[-1]
    mean = finite.sum(dims) / count
    square_norm = (finite * finite).sum(dims)
    std = (square_norm / count - mean * mean).clamp_min(0).sqrt()
    return finite.amin(dims), finite.amax(dims), mean, std, square_norm


def pack(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``x`` (channels last) packed in planes along each row: (*x.shape[:-1], packed_width(C, bits))
    uint8."""
    per_byte, width = 8 // bits, packed_width(x.shape[-1], bits)
    half = zero + 0.5
    t = x.float() * (1.0 / scale) + half
    t = torch.where(t == t, t, half)  # NaN stores the zero code
    codes = torch.clamp(torch.floor(t), 0, 2**bits - 1)
    pad = per_byte * width - x.shape[-1]
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    packed = codes[..., :width]
    for k in range(1, per_byte):
        packed = packed + codes[..., k * width:(k + 1) * width] * float(2 ** (k * bits))
    return packed.to(torch.uint8)


def unpack(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, channels: int
           ) -> torch.Tensor:
    """The float32 values ``pack`` stored: (*packed.shape[:-1], channels)."""
    rest, planes = packed.float(), []
    for _ in range(8 // bits - 1):
        high = torch.floor(rest * (1.0 / 2**bits))
        planes.append(rest - high * 2**bits)
        rest = high
    codes = torch.cat([*planes, rest], -1) if planes else rest
    if codes.shape[-1] != channels:
        codes = codes[..., :channels]
    return (codes - zero) * scale


def select_outlier_values(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, chunk: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(index in its chunk, uint8; value) of the value of each chunk of each row farthest from its channel's
    mean in standard deviations; a chunk past the last channel holds padding, which is never the farthest."""
    channels = x.shape[-1]
    deviation = (x.float() - mean).abs() * (1.0 / std.clamp_min(torch.finfo(torch.float32).tiny))
    deviation = torch.where(x.abs() < float("inf"), deviation, float("inf"))
    pad = -channels % chunk
    if pad:
        deviation = torch.nn.functional.pad(deviation, (0, pad), value=-1.0)
    # argmax as one integer max: a deviation's float bits order as int32 (it is >= 0, padding's < 0); the low
    # bits carry the lane, so the max is the farthest value (to 2^-16 relative, ties to the higher lane).
    lanes = torch.arange(channels + pad, device=x.device, dtype=torch.int32) % chunk
    key = (deviation.view(torch.int32) & ~(chunk - 1)) | lanes
    index = key.unflatten(-1, (-1, chunk)).amax(-1) & (chunk - 1)
    starts = torch.arange(0, channels + pad, chunk, device=x.device, dtype=torch.int32)
    values = x.gather(-1, (index + starts).clamp_max(channels - 1).long())
    return index.to(torch.uint8), values


def restore_outlier_values(x: torch.Tensor, index: torch.Tensor, values: torch.Tensor, chunk: int
                           ) -> torch.Tensor:
    """``x`` with the outlier values written back: element-wise, so it fuses with whatever reads ``x``."""
    channels = x.shape[-1]
    lanes = torch.arange(channels, device=x.device, dtype=torch.int32)
    spread = [*index.shape, chunk]

    def per_channel(t: torch.Tensor) -> torch.Tensor:  # each chunk's entry repeated over its channels
        return t.unsqueeze(-1).expand(spread).flatten(-2)[..., :channels]

    kept = (per_channel(index.int()) + lanes - lanes % chunk).clamp_max(channels - 1) == lanes
    return torch.where(kept, per_channel(values).to(x.dtype), x)


def quantize(x: torch.Tensor, spec: QuantSpec, slot: int | None = None) -> tuple[torch.Tensor, ...]:
    """What is saved instead of ``x`` (channels last): (packed codes, scale, zero, outlier channel ids, their
    values, outlier value indices, outlier values). ``slot``: a calibration slot (fxmem.kernels.calibration)
    that gives the scales and outlier channels from its statistics; None: from this batch's."""
    low, high, mean, std, square_norm = channel_stats(x)
    if spec.chunk:
        index, values = select_outlier_values(x, mean, std, spec.chunk)
        low, high = torch.maximum(low, mean - SPREAD * std), torch.minimum(high, mean + SPREAD * std)
    else:
        index, values = x.new_empty((*x.shape[:-1], 0), dtype=torch.uint8), x.new_empty((*x.shape[:-1], 0))
    if slot is None:
        scale, zero = quant_params(low, high, spec.bits)
        ids = (torch.topk(square_norm, spec.outliers).indices.sort().values if spec.outliers
               else torch.empty(0, dtype=torch.long, device=x.device))
    else:
        scale, zero, ids = torch.ops.fxmem.calibrated_params(low, high, square_norm, slot)
    channel_values = x.index_select(-1, ids)
    return pack(x, scale, zero, spec.bits), scale, zero, ids, channel_values, index, values


def dequantize(parts: tuple[torch.Tensor, ...], spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``quantize`` stored, in ``dtype``, outlier channels and values exact."""
    packed, scale, zero, ids, channel_values, index, values = parts
    x = unpack(packed, scale, zero, spec.bits, spec.channels).to(dtype)
    if spec.outliers:
        x = x.index_copy(-1, ids, channel_values)
    if spec.chunk:
        x = restore_outlier_values(x, index, values, spec.chunk)
    return x
