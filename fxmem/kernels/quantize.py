"""Per-channel quantization with real bit packing, and outlier-channel split/merge.

The math is HyC-LoRA's equations (1)-(2): per channel (the tensor's last,
contiguous dimension) a scale s and an integer zero point; a value x is stored
as the unsigned code ``clamp(floor(x / s + zero + 1/2), 0, 2**bits - 1)`` and
read back as ``(code - zero) * s``. ``zero`` here is the paper's z shifted by
2**(bits-1) so codes are unsigned; the asymmetric zero rounds the channel's
minimum onto the grid, the symmetric one is the middle code.

Codes are packed in the tensor's flat (row-major) order, 8 // bits to a byte,
the first value in the lowest bits: a 2-bit tensor of n values takes
ceil(n / 4) bytes. Outlier channels are gathered in full precision before
quantizing and written back over their (meaningless) codes after dequantizing.
Outlier values (dense-and-sparse) likewise: ``split_outlier_values`` takes the
values farthest from their channel's mean out (their flat positions as int32 and
their values in the tensor's dtype), sets them to that mean so that they widen
no channel's range, and ``dequantize`` writes them back last.

Each op has a torch reference (the CPU path, and the oracle the tests hold the
Triton kernels to) and a Triton kernel used on CUDA. Both compute
``x * (1 / s)`` with ``1 / s`` precomputed in torch, so they agree bit for bit.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch reference is the only path, and all CPU needs
    triton = None

BITS_CHOICES = (1, 2, 4, 8)  # the widths the packing supports: 8 // bits codes to a byte


def check_bits(bits: int) -> None:
    if bits not in BITS_CHOICES:
        raise ValueError(f"bits must be one of {', '.join(map(str, BITS_CHOICES))}; got {bits!r}")


def packed_numel(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits take once packed."""
    return (numel * bits + 7) // 8


def quant_params(low: torch.Tensor, high: torch.Tensor, bits: int, *, symmetric: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (scale, zero) from per-channel min and max, as equation (1).

    Non-finite bounds count as 0. A constant channel (max == min) gets the
    scale |value| (1 for zero) and a zero point that reproduces the value
    exactly, so it never divides by zero or yields NaN.
    """
    check_bits(bits)
    low = torch.nan_to_num(low.float(), nan=0.0, posinf=0.0, neginf=0.0)
    high = torch.nan_to_num(high.float(), nan=0.0, posinf=0.0, neginf=0.0)
    low, high = torch.minimum(low, high), torch.maximum(low, high)
    if symmetric:
        if bits == 1:
            raise ValueError("symmetric quantization needs at least 2 bits (1 bit has no zero code)")
        bound = torch.maximum(low.abs(), high.abs())
        scale = bound / (2 ** (bits - 1) - 1)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return scale, torch.full_like(scale, 2 ** (bits - 1))
    scale = (high - low) / (2**bits - 1)
    constant = torch.where(high != 0, high.abs(), torch.ones_like(high))
    scale = torch.where(scale > 0, scale, constant)
    zero = -torch.round(low / scale)
    return scale, zero


def _codes_reference(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    t = x.float() * (1.0 / scale) + (zero + 0.5)
    t = torch.where(torch.isnan(t), zero + 0.5, t)  # NaN stores the zero code: dequantizes to 0, finite
    return torch.clamp(torch.floor(t), 0, 2**bits - 1).to(torch.uint8)


def quantize_reference(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Packed codes of contiguous ``x`` (channels last) as a flat uint8 tensor."""
    per_byte = 8 // bits
    codes = _codes_reference(x.reshape(-1, x.shape[-1]), scale, zero, bits).reshape(-1)
    pad = (-codes.numel()) % per_byte
    codes = torch.nn.functional.pad(codes, (0, pad)).reshape(-1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, dtype=torch.int32, device=x.device) * bits
    return (codes << shifts).sum(dim=1).to(torch.uint8)


def dequantize_reference(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                         shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32, device=packed.device) * bits
    codes = (packed.to(torch.int32).unsqueeze(1) >> shifts) & (2**bits - 1)
    numel = math.prod(shape)
    codes = codes.reshape(-1)[:numel].reshape(-1, shape[-1]).float()
    return ((codes - zero) * scale).to(dtype).reshape(shape)


# A ratio in millionths: the count is integer arithmetic on the size, which may be symbolic while tracing.
_RATIO_UNITS = 10**6
MAX_OUTLIER_VALUE_POSITION = 2**31 - 1  # positions are int32
_SAMPLE_STRIDE = 64


def outlier_value_count(numel: int, ratio: float) -> int:
    """How many of ``numel`` values ``ratio`` (Config.outlier_values) keeps exact."""
    return numel * round(ratio * _RATIO_UNITS) // _RATIO_UNITS


def split_outlier_values(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``x`` with its ``count`` values farthest from their channel's mean, in channel standard deviations, set
    to that mean; their flat positions, int32; their values) for contiguous ``x``, channels last.

    Non-finite values count as 0 in the channel statistics and as the farthest of all: kept exact first.
    """
    if x.numel() > MAX_OUTLIER_VALUE_POSITION:
        raise ValueError(f"outlier values address at most 2^31 values by int32 position; this tensor has "
                         f"{x.numel()}: set outlier_values=0")
    flat = x.reshape(-1)
    rows = torch.nan_to_num(x.reshape(-1, x.shape[-1]).float(), nan=0.0, posinf=0.0, neginf=0.0)
    std, mean = torch.std_mean(rows, dim=0, correction=0)
    deviation = ((rows - mean) / std.clamp_min(torch.finfo(torch.float32).tiny)).reshape(-1).abs_()
    positions = _largest(deviation.masked_fill_(~torch.isfinite(flat), float("inf")), count)
    rest = flat.clone()
    rest[positions] = mean.to(x.dtype)[positions % x.shape[-1]]
    return rest.view_as(x), positions.to(torch.int32), flat[positions]


def _largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """Positions of the ``count`` largest of flat ``values``, exactly; a strided sample's quantile first narrows
    the candidates (a full top-k over millions of values is most of the cost on the CPU)."""
    sample = values[::_SAMPLE_STRIDE]
    threshold = sample.topk(min(sample.numel(), 2 * count // _SAMPLE_STRIDE + 1)).values[-1]
    candidates = (values >= threshold).nonzero().squeeze(1)
    if candidates.numel() < count:
        return values.topk(count).indices
    return candidates[values[candidates].topk(count).indices]


if triton is not None:
    @triton.jit
    def _quantize_kernel(x_ptr, inv_scale_ptr, zero_ptr, out_ptr, numel, channels,
                         BITS: tl.constexpr, BLOCK: tl.constexpr):
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        packed = tl.zeros([BLOCK], dtype=tl.int32)
        for k in tl.static_range(per_byte):
            index = byte * per_byte + k
            mask = index < numel
            channel = index % channels
            x = tl.load(x_ptr + index, mask=mask, other=0.0).to(tl.float32)
            inv_scale = tl.load(inv_scale_ptr + channel, mask=mask, other=1.0)
            zero = tl.load(zero_ptr + channel, mask=mask, other=0.0)
            t = x * inv_scale + (zero + 0.5)
            t = tl.where(t != t, zero + 0.5, t)  # noqa: PLR0124 (NaN test)
            code = tl.minimum(tl.maximum(tl.floor(t), 0.0), 2**BITS - 1.0).to(tl.int32)
            code = tl.where(mask, code, 0)
            packed = packed | (code << (k * BITS))
        tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte * per_byte < numel)


    @triton.jit
    def _dequantize_kernel(packed_ptr, scale_ptr, zero_ptr, out_ptr, numel, channels,
                           BITS: tl.constexpr, BLOCK: tl.constexpr):
        per_byte: tl.constexpr = 8 // BITS
        byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        packed = tl.load(packed_ptr + byte, mask=byte * per_byte < numel, other=0).to(tl.int32)
        for k in tl.static_range(per_byte):
            index = byte * per_byte + k
            mask = index < numel
            channel = index % channels
            code = ((packed >> (k * BITS)) & (2**BITS - 1)).to(tl.float32)
            scale = tl.load(scale_ptr + channel, mask=mask, other=0.0)
            zero = tl.load(zero_ptr + channel, mask=mask, other=0.0)
            tl.store(out_ptr + index, ((code - zero) * scale).to(out_ptr.dtype.element_ty), mask=mask)


    _BLOCK = 1024


    def quantize_triton(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
        """The Triton kernel behind ``quantize_reference`` (same bytes)."""
        numel = x.numel()
        out = torch.empty(packed_numel(numel, bits), dtype=torch.uint8, device=x.device)
        grid = (triton.cdiv(out.numel(), _BLOCK),)
        # No fused multiply-add: torch rounds x * (1 / s) and + zero separately, and so must the kernel.
        _quantize_kernel[grid](x, (1.0 / scale).contiguous(), zero.contiguous(), out, numel, x.shape[-1],
                               BITS=bits, BLOCK=_BLOCK, enable_fp_fusion=False)
        return out


    def dequantize_triton(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
                          shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
        grid = (triton.cdiv(packed.numel(), _BLOCK),)
        _dequantize_kernel[grid](packed, scale.contiguous(), zero.contiguous(), out, out.numel(), shape[-1],
                                 BITS=bits, BLOCK=_BLOCK)
        return out


def _uses_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and triton is not None


@torch.library.custom_op("fxmem::quantize", mutates_args=())
def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, outlier_channels: torch.Tensor,
             bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, outlier columns) of ``x``; channels are the last dimension.

    ``outlier_channels`` lists channel ids kept in full precision (may be empty);
    the outlier columns keep ``x``'s dtype and leading shape: (*x.shape[:-1], k).
    """
    x = x.contiguous()
    outliers = x.index_select(-1, outlier_channels)
    packed = (quantize_triton if _uses_triton(x) else quantize_reference)(x, scale, zero, bits)
    return packed, outliers


@quantize.register_fake
def _(x, scale, zero, outlier_channels, bits):
    packed = x.new_empty(packed_numel(x.numel(), bits), dtype=torch.uint8)
    return packed, x.new_empty((*x.shape[:-1], outlier_channels.shape[0]))


@torch.library.custom_op("fxmem::dequantize", mutates_args=())
def dequantize(packed: torch.Tensor, outliers: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
               outlier_channels: torch.Tensor, bits: int, value_positions: torch.Tensor | None = None,
               values: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor ``quantize`` packed, with its outlier channels and outlier values restored exactly.

    Its shape is ``(*outliers.shape[:-1], scale.numel())`` and its dtype the
    outliers': the outlier tensor carries them even when it has no columns.
    ``value_positions`` and ``values`` are ``split_outlier_values``'s (flat positions, values), if any.
    """
    shape = (*outliers.shape[:-1], scale.numel())
    x = (dequantize_triton if _uses_triton(packed) else dequantize_reference)(
        packed, scale, zero, bits, shape, outliers.dtype)
    if outlier_channels.numel():
        x.index_copy_(-1, outlier_channels, outliers)
    if value_positions is not None and value_positions.numel():
        x.view(-1)[value_positions.long()] = values
    return x


@dequantize.register_fake
def _(packed, outliers, scale, zero, outlier_channels, bits, value_positions=None, values=None):
    return outliers.new_empty((*outliers.shape[:-1], scale.shape[0]))
