"""NF4 weights through bitsandbytes, and fxmem::nf4_linear, a linear that reads one without keeping it dequantized.

A weight is stored as bitsandbytes' NF4 with double-quantized scales (QLoRA's
format, block 64): these tensors, which ``nf4_nbytes`` counts exactly,

- ``packed``: two 4-bit NF4 codes a byte, ceil(numel / 2) bytes;
- ``absmax``: one 8-bit code per block of 64 values (the block scales, themselves
  quantized with bitsandbytes' 8-bit dynamic code in blocks of 256);
- ``absmax_scale``: one float32 per 256 blocks (the scales' scale);
- ``absmax_offset``: one float32 (the scales' mean, subtracted before quantizing them).

The NF4 table and the 8-bit dynamic code are constants shared by every weight, so
they are not stored per weight.

``nf4_linear(x, ...)`` is ``x @ deq(W)^T``; its backward is ``dy @ deq(W)`` and no
weight gradient (the weight is frozen). Both dequantize inside the op, so the
full-precision weight lives only while one op runs, in eager and in compiled code:
a plain ``F.linear(x, deq(W))`` would keep every layer's dequantized weight from
forward to backward.

bitsandbytes is imported on first use: the ops are registered without it.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch

BLOCK = 64  # values per NF4 block (QLoRA's, and the LoQT paper's)
ABSMAX_BLOCK = 256  # block scales per float32 scale in the double quantization (bitsandbytes' fixed value)


@functools.cache
def bitsandbytes():
    """The bitsandbytes module (its ops registered), or an error saying how to install it."""
    try:
        # bitsandbytes warns at import that an optional CPU gemv kernel package is absent; fxmem never uses it.
        cpu_ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
        level = cpu_ops.level
        cpu_ops.setLevel(logging.ERROR)
        try:
            import bitsandbytes as bnb
        finally:
            cpu_ops.setLevel(level)
    except ImportError as error:
        raise ModuleNotFoundError("NF4 weights need bitsandbytes: pip install 'bitsandbytes>=0.50'") from error
    return bnb


@functools.cache
def _dynamic_code(device: torch.device) -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code: the one its double quantization stores the block scales in."""
    return bitsandbytes().functional.create_dynamic_map(signed=True).to(device)


@dataclass(frozen=True)
class NF4Parts:
    """The four stored tensors of one NF4 weight (see the module docstring)."""

    packed: torch.Tensor
    absmax: torch.Tensor
    absmax_scale: torch.Tensor
    absmax_offset: torch.Tensor


def nf4_layout(numel: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each stored tensor of a weight with ``numel`` values, in bitsandbytes' layout."""
    blocks = math.ceil(numel / BLOCK)
    return {"packed": (((numel + 1) // 2, 1), torch.uint8), "absmax": ((blocks,), torch.uint8),
            "absmax_scale": ((math.ceil(blocks / ABSMAX_BLOCK),), torch.float32), "absmax_offset": ((), torch.float32)}


def nf4_nbytes(numel: int) -> int:
    """Bytes an NF4 weight of ``numel`` values takes: codes, 8-bit block scales, their float32 scales and offset."""
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in nf4_layout(numel).values())


def nf4_quantize(weight: torch.Tensor) -> NF4Parts:
    """``weight`` (any float dtype) as NF4, block 64, double-quantized scales."""
    functional = bitsandbytes().functional
    packed, state = functional.quantize_4bit(weight.detach().contiguous(), blocksize=BLOCK,
                                             compress_statistics=True, quant_type="nf4")
    return NF4Parts(packed=packed, absmax=state.absmax, absmax_scale=state.state2.absmax,
                    absmax_offset=state.offset.reshape(()).float())


def nf4_dequantize(packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor,
                   absmax_offset: torch.Tensor, shape: tuple[int, ...] | list[int], dtype: torch.dtype
                   ) -> torch.Tensor:
    """The weight of ``shape`` that ``nf4_quantize`` stored, in ``dtype``."""
    bitsandbytes()  # registers torch.ops.bitsandbytes
    ops = torch.ops.bitsandbytes
    scales = ops.dequantize_blockwise.default(absmax, absmax_scale, _dynamic_code(absmax.device), ABSMAX_BLOCK,
                                              torch.float32) + absmax_offset
    return ops.dequantize_4bit.default(packed, scales, BLOCK, "nf4", list(shape), dtype)


@torch.library.custom_op("fxmem::nf4_linear", mutates_args=())
def nf4_linear(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, absmax_scale: torch.Tensor,
               absmax_offset: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W^T`` for the NF4 weight W of shape (out_features, x.shape[-1])."""
    weight = nf4_dequantize(packed, absmax, absmax_scale, absmax_offset, (out_features, x.shape[-1]), x.dtype)
    return torch.nn.functional.linear(x, weight)


@nf4_linear.register_fake
def _(x, packed, absmax, absmax_scale, absmax_offset, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("fxmem::nf4_linear_input_grad", mutates_args=())
def nf4_linear_input_grad(grad: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor,
                          absmax_scale: torch.Tensor, absmax_offset: torch.Tensor, in_features: int) -> torch.Tensor:
    """``grad @ W`` for the NF4 weight W of shape (grad.shape[-1], in_features): nf4_linear's input gradient."""
    weight = nf4_dequantize(packed, absmax, absmax_scale, absmax_offset, (grad.shape[-1], in_features), grad.dtype)
    return grad @ weight


@nf4_linear_input_grad.register_fake
def _(grad, packed, absmax, absmax_scale, absmax_offset, in_features):
    return grad.new_empty((*grad.shape[:-1], in_features))


def _setup_context(ctx, inputs, output) -> None:
    x, packed, absmax, absmax_scale, absmax_offset, _ = inputs
    ctx.save_for_backward(packed, absmax, absmax_scale, absmax_offset)
    ctx.in_features = x.shape[-1]


def _backward(ctx, grad):
    packed, absmax, absmax_scale, absmax_offset = ctx.saved_tensors
    grad_x = None
    if ctx.needs_input_grad[0]:
        grad_x = nf4_linear_input_grad(grad, packed, absmax, absmax_scale, absmax_offset, ctx.in_features)
    return grad_x, None, None, None, None, None


nf4_linear.register_autograd(_backward, setup_context=_setup_context)
