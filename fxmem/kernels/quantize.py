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
and j % 2, and its C++ fell back to scalar loops; measured: docs/quantization.md). The arithmetic is
in float32, exact for bytes: a shift by a constant is a multiplication by a power of two, which vectorizes where
inductor's uint8 shifts do not. The fused LoRA epilogue kernels (fxmem/kernels/lora_epilogue.py) read the same
layout.

Outlier channels (``outliers``): the channels with the largest L2 norm, kept in full precision beside the
codes and written back over theirs. Outlier values (``chunk``): of each row, the value of each chunk of
``chunk`` channels farthest from its channel's mean in channel standard deviations is kept exactly, with its
index in the chunk as one byte. The selection has a fixed shape: no data-dependent size, no host
synchronisation.

Fitted ranges (2 bits and fewer, ``FITTED_SPREADS``): a channel's grid is the one, of its whole range and its
mean +- k standard deviations (within its minimum and maximum) for a few k, whose codes have the least squared
error on the batch, found in one more pass over the tensor. Values outside the chosen grid are clamped to it,
unless a chunk keeps them exactly.

Options (HyC-LoRA has neither; issue 28 measures both on a pretrained decoder, docs/quantization.md):
- Rotation (``rotation``): each row's channels, in blocks of ``rotation``, are multiplied by a fixed randomized
  Hadamard matrix (orthogonal: a Sylvester Hadamard matrix / sqrt(block), its rows' signs flipped by a fixed
  pseudo-random pattern) before the statistics, and by its transpose after restoring: a channel's outliers are
  spread over its block, as the rotation papers for LLM quantization do. Built from arange ops, so it traces
  as a constant inductor folds, with no weight to carry.
- Stochastic rounding (``stochastic``): codes round down or up with probability equal to the distance, so a
  restored value's expectation is the value clamped to the grid (an unbiased gradient inside the grid) at the
  price of a larger error on each batch.

Statistics treat non-finite values as 0; a NaN is stored as the zero code, an infinity as the end code, and
non-finite values count as the farthest of all, so an outlier value keeps one exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxmem.choices import BITS_CHOICES

# The grids a channel's range is fitted among, at these widths: mean +- k standard deviations for each k, and the
# channel's whole range. Four levels over a Gaussian channel's whole range (about +-3.3 std over a thousand rows)
# leave half its values 0.5 std or more from their level; the least-squares grid of four is near +-1.5 std.
# Fitting lowered the LoRA gradients' error at 2 bits against a fixed mean +- 3 std. A 1.5 std candidate lowered
# the median error further but the worst gradient too: a clamp is a bias along the activation itself. At 4 bits the
# whole range stays: clamps cost gradient cosine there (measured: docs/quantization.md).
FITTED_SPREADS = {1: (1.0, 1.5, 2.0), 2: (2.0, 2.5, 3.0)}
# The fit reads every 8th row: a choice among four grids needs no more, and reading every row cost a larger share
# of the step for the same gradient errors (measured: docs/quantization.md).
FIT_ROW_STRIDE = 8


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


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


MIN_ROTATION_BLOCK = 8


def rotation_block(channels: int, block: int) -> int:
    """The Hadamard block a tensor of ``channels`` gets for Config.rotation ``block``: the largest power of two
    up to ``block`` that divides ``channels``; 0 (no rotation) below MIN_ROTATION_BLOCK, too few channels to
    spread an outlier over."""
    size = min(block, channels & -channels)  # channels & -channels: the largest power of two dividing it
    return size if size >= MIN_ROTATION_BLOCK else 0


@dataclass(frozen=True)
class QuantSpec:
    """How one saved tensor is stored: the channels (its last dimension), the bits of its codes, its outlier
    channels, the chunk of channels that keeps one outlier value per row (0: none), the Hadamard block its rows
    are rotated in (0: none), whether codes round stochastically, and whether every positive value stays positive
    (and zero zero: what a ReLU's backward reads of its saved output)."""

    channels: int
    bits: int
    outliers: int = 0
    chunk: int = 0
    rotation: int = 0
    stochastic: bool = False
    keep_positive: bool = False

    def __post_init__(self) -> None:
        check_bits(self.bits)
        if self.chunk and (not _power_of_two(self.chunk) or self.chunk > 256):
            raise ValueError(f"chunk must be a power of two up to 256 (its index is a byte); got {self.chunk}")
        if self.keep_positive and (self.rotation or self.stochastic):
            raise ValueError("keep_positive reads the values' own signs: not with rotation or stochastic rounding")
        if self.rotation and (not _power_of_two(self.rotation) or self.channels % self.rotation):
            raise ValueError(f"rotation must be a power of two that divides the channels ({self.channels}); "
                             f"got {self.rotation}")


def quant_params(low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, zero) from per-channel min and max, as equation (1). A constant channel (max == min)
    gets the scale |value| (1 for zero) and a zero point that reproduces the value exactly."""
    check_bits(bits)
    low, high = torch.minimum(low, high), torch.maximum(low, high)
    scale = (high - low) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.where(high != 0, high.abs(), 1.0))
    return scale, -torch.round(low / scale)


def _finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 with its non-finite values as 0."""
    x = x.float()
    return torch.where(x.abs() < float("inf"), x, 0.0)  # abs() < inf vectorizes; isnan does not


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per channel (last dimension) over every other, in float32, non-finite values as 0: (min, max, mean,
    standard deviation, squared L2 norm). One pass: inductor computes the five in one loop.

    The variance is taken about a shift, each channel's first value, not as E[x^2] - mean^2: that difference of
    two large numbers cancels whole for a channel whose mean is large against its spread (mean 1000, std 0.05:
    std 0 in fp32), and a bf16 activation's channels often are. About a value of the channel, the sums stay of
    the spread's size (the shifted-data algorithm)."""
    finite = _finite(x).reshape(-1, x.shape[-1])  # (rows, channels), a 1-D x one row
    count = finite.shape[0]
    shift = finite[:1].sum(0)  # the first row
    centred = finite - shift
    offset = centred.sum(0) / count
    std = ((centred * centred).sum(0) / count - offset * offset).clamp_min(0).sqrt()
    return finite.amin(0), finite.amax(0), shift + offset, std, (finite * finite).sum(0)


def fits_range(bits: int) -> bool:
    """Whether a channel's range is fitted at this width (FITTED_SPREADS)."""
    return bits in FITTED_SPREADS


def fit_reads(bits: int) -> float:
    """Reads of the tensor the fit adds, in whole tensors: each candidate's error reads the sampled rows."""
    return (1 + len(FITTED_SPREADS[bits])) / FIT_ROW_STRIDE if fits_range(bits) else 0.0


def fitted_range(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, mean: torch.Tensor, std: torch.Tensor,
                 bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, the (low, high) of the whole range [low, high] and of mean +- k std within it (k in
    FITTED_SPREADS[bits]) whose codes have the least squared error over every FIT_ROW_STRIDE-th row's finite
    values; the first on a tie. The candidates are stacked, so inductor computes every error in one reduction
    instead of materializing each candidate's element-wise errors."""
    spreads = FITTED_SPREADS[bits]
    lows = torch.stack([low, *(torch.maximum(low, mean - k * std) for k in spreads)])  # (candidates, channels)
    highs = torch.stack([high, *(torch.minimum(high, mean + k * std) for k in spreads)])
    scale, zero = quant_params(lows, highs, bits)
    finite = _finite(x).reshape(-1, x.shape[-1])[::FIT_ROW_STRIDE].unsqueeze(0)
    restored = (_codes(finite, scale.unsqueeze(1), zero.unsqueeze(1), bits) - zero.unsqueeze(1)) * scale.unsqueeze(1)
    best = (restored - finite).square().sum(1).argmin(0, keepdim=True)
    return lows.gather(0, best)[0], highs.gather(0, best)[0]


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, stochastic: bool = False,
           keep_positive: bool = False) -> torch.Tensor:
    """Equation (1)'s codes of ``x`` in float32, rounded to nearest or stochastically; NaN stores the zero code.
    ``keep_positive``: a positive value that would round to the zero code takes the code above it (the grid must
    hold zero, as ``quantize`` makes it; a negative value never rounds above zero's code)."""
    half = zero + 0.5
    offset = zero + torch.rand_like(x, dtype=torch.float32) if stochastic else half
    x = x.float()
    t = x * (1.0 / scale) + offset
    t = torch.where(t == t, t, half)
    codes = torch.clamp(torch.floor(t), 0, 2**bits - 1)
    if keep_positive:
        codes = torch.where((x > 0) & (codes <= zero), torch.clamp(zero + 1, max=2**bits - 1), codes)
    return codes


def pack(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, stochastic: bool = False,
         keep_positive: bool = False) -> torch.Tensor:
    """Codes of ``x`` (channels last) packed in planes along each row: (*x.shape[:-1], packed_width(C, bits))
    uint8."""
    per_byte, width = 8 // bits, packed_width(x.shape[-1], bits)
    codes = _codes(x, scale, zero, bits, stochastic, keep_positive)
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


def hadamard_rotation(block: int, device: torch.device | str) -> torch.Tensor:
    """The (block, block) orthogonal matrix rows are rotated by: diag(signs) H / sqrt(block), H the Sylvester
    Hadamard matrix (H[i, j] = (-1)^popcount(i & j)), the signs a fixed pseudo-random pattern (a bit of an integer
    hash of the row index, kept below 2**63: no overflow in generated C++). Made of arange ops: traced, it is a
    constant."""
    index = torch.arange(block, device=device, dtype=torch.int64)
    both = index.unsqueeze(1) & index.unsqueeze(0)
    parity = torch.zeros_like(both)
    for bit in range(block.bit_length() - 1):
        parity = parity ^ ((both >> bit) & 1)
    mixed = index * 2654435761
    mixed = (mixed ^ (mixed >> 15)) & 0x7FFFFFFF
    signs = 1 - 2 * (((mixed * 2246822519) >> 29) & 1)
    return (1 - 2 * parity).float() * signs.float().unsqueeze(1) * block**-0.5


def rotate(x: torch.Tensor, block: int, inverse: bool = False) -> torch.Tensor:
    """``x`` (channels last) in float32 with each row's blocks of ``block`` channels rotated (or rotated back)."""
    rotation = hadamard_rotation(block, x.device)
    blocks = x.float().unflatten(-1, (-1, block))
    return (blocks @ (rotation.T if inverse else rotation)).flatten(-2)


def quantize(x: torch.Tensor, spec: QuantSpec, slot: int | None = None) -> tuple[torch.Tensor, ...]:
    """What is saved instead of ``x`` (channels last): (packed codes, scale, zero, outlier channel ids, their
    values, outlier value indices, outlier values), of ``x`` rotated if the spec says so. ``slot``: a
    calibration slot (fxmem.kernels.calibration) that gives the scales and outlier channels from its
    statistics; None: from this batch's."""
    if spec.rotation:
        x = rotate(x, spec.rotation).to(x.dtype)
    low, high, mean, std, square_norm = channel_stats(x)
    if spec.chunk:
        index, values = select_outlier_values(x, mean, std, spec.chunk)
    else:
        index, values = x.new_empty((*x.shape[:-1], 0), dtype=torch.uint8), x.new_empty((*x.shape[:-1], 0))
    if fits_range(spec.bits):
        low, high = fitted_range(x, low, high, mean, std, spec.bits)
    if spec.keep_positive:  # zero on the grid: it comes back exactly, and positive values have codes above it
        low, high = torch.clamp(low, max=0.0), torch.clamp(high, min=0.0)
    if slot is None:
        scale, zero = quant_params(low, high, spec.bits)
        ids = (torch.topk(square_norm, spec.outliers).indices.sort().values if spec.outliers
               else torch.empty(0, dtype=torch.long, device=x.device))
    else:
        scale, zero, ids = torch.ops.fxmem.calibrated_params(low, high, square_norm, slot)
    channel_values = x.index_select(-1, ids)
    packed = pack(x, scale, zero, spec.bits, spec.stochastic, spec.keep_positive)
    return packed, scale, zero, ids, channel_values, index, values


def dequantize(parts: tuple[torch.Tensor, ...], spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``quantize`` stored, in ``dtype``, outlier channels and values exact."""
    packed, scale, zero, ids, channel_values, index, values = parts
    x = unpack(packed, scale, zero, spec.bits, spec.channels).to(dtype)
    if spec.outliers:
        x = x.index_copy(-1, ids, channel_values)
    if spec.chunk:
        x = restore_outlier_values(x, index, values, spec.chunk)
    if spec.rotation:
        x = rotate(x, spec.rotation, inverse=True).to(dtype)
    return x
