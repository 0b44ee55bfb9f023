"""Fused epilogues of LoRA linears feeding an activation: SwiGLU (gate, up) and GELU.

A LoRA linear's output is Y = Y_W + s (XA) B^T: Y_W = X W^T the frozen part
(n x o), XA the exact rank-r product (n x r), B the LoRA B weight (o x r,
PEFT's ``lora_B.weight`` layout) and s the scaling. HyC-LoRA keeps Y_W for
backward only quantized (fxmem/kernels/quantize.py's packed per-channel codes,
no outlier channels) and rebuilds Y = deq(Y_W) + s (XA) B^T where the
activation's gradient needs it, so neither Y nor the activation's output is
ever materialized for backward.

- ``lora_swiglu_backward``: gate and up rebuilt, h = silu(gate) up, and
  dL/dgate, dL/dup from dL/dh; h comes back too (down_proj's LoRA needs it).
- ``lora_gelu_backward``: y rebuilt, a = gelu(y) and dL/dy from dL/da.
- ``lora_swiglu_forward`` / ``lora_gelu_forward``: the same epilogue in forward,
  on the unquantized Y_W, so the LoRA term is added in the activation's pass.

Each op has a torch reference (the CPU path, and the oracle the tests hold the
Triton kernels to) and a Triton kernel used on CUDA: a 2-D tile of rows x
channels that dequantizes (or loads) Y_W, computes its tile of (XA) B^T with
tl.dot over r in steps of 16, and applies the activation, all
in fp32. Outputs take the dtype of the op's first tensor argument.
"""

from __future__ import annotations

import contextlib
import math

import torch

from fxmem.kernels.quantize import check_bits, packed_width, unpack

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch reference is the only path, and all CPU needs
    triton = None

GELU_APPROXIMATIONS = ("none", "tanh")
# LoRA ranks only: past this the (XA) B^T product is a full matmul, for cuBLAS rather than an epilogue.
MAX_RANK = 256


def check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {', '.join(map(repr, GELU_APPROXIMATIONS))}; "
                         f"got {approximate!r}")


def _check_lora_factors(prefix: str, xa: torch.Tensor, b: torch.Tensor, rows: int, channels: int) -> None:
    if xa.dim() != 2 or xa.shape[0] != rows:
        raise ValueError(f"{prefix}xa must be (rows, r) = ({rows}, r); got shape {tuple(xa.shape)}")
    if tuple(b.shape) != (channels, xa.shape[1]):
        raise ValueError(f"{prefix}b must be (channels, r) = ({channels}, {xa.shape[1]}); "
                         f"got shape {tuple(b.shape)}")


def _check_quantized(prefix: str, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, xa: torch.Tensor,
                     b: torch.Tensor, shape: torch.Size, bits: int) -> None:
    """The packed Y_W, per-channel parameters and LoRA factors fit an output of ``shape``."""
    channels = shape[-1]
    rows = math.prod(shape) // channels  # torch.Size.numel() would make a symbolic size a number
    expected = rows * packed_width(channels, bits)
    if packed.numel() != expected or not packed.is_contiguous():
        raise ValueError(f"{prefix}packed must hold {expected} contiguous bytes ({rows} x {channels} codes of {bits} "
                         f"bits); got shape {tuple(packed.shape)}")
    if scale.numel() != channels or zero.numel() != channels:
        raise ValueError(f"{prefix}scale and {prefix}zero must have one value per channel ({channels}); "
                         f"got {scale.numel()} and {zero.numel()}")
    _check_lora_factors(prefix, xa, b, rows, channels)


def _check_unquantized(prefix: str, base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, shape: torch.Size) -> None:
    if base.shape != shape:
        raise ValueError(f"{prefix}base must have shape {tuple(shape)}; got {tuple(base.shape)}")
    _check_lora_factors(prefix, xa, b, math.prod(shape) // shape[-1], shape[-1])


# --- torch references -------------------------------------------------------------------------------------------

def _lora_term(xa: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    return scaling * (xa.float() @ b.float().t())


def _rebuilt(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
             scaling: float, bits: int, rows: int, channels: int) -> torch.Tensor:
    """deq(Y_W) + s (XA) B^T, (rows, channels) in fp32."""
    y_w = unpack(packed.reshape(rows, -1), scale, zero, bits, channels)
    return y_w + _lora_term(xa, b, scaling)


def _swiglu_grads(grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dgate, dL/dup, h) in fp32 for h = silu(gate) up; silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))."""
    sig = torch.sigmoid(gate)
    silu = gate * sig
    return grad_h * up * sig * (1 + gate * (1 - sig)), grad_h * silu, silu * up


def lora_swiglu_backward_reference(
        grad_h: torch.Tensor, gate_packed: torch.Tensor, gate_scale: torch.Tensor, gate_zero: torch.Tensor,
        gate_xa: torch.Tensor, gate_b: torch.Tensor, gate_scaling: float, up_packed: torch.Tensor,
        up_scale: torch.Tensor, up_zero: torch.Tensor, up_xa: torch.Tensor, up_b: torch.Tensor, up_scaling: float,
        bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    channels = grad_h.shape[-1]
    rows = grad_h.numel() // channels
    gate = _rebuilt(gate_packed, gate_scale, gate_zero, gate_xa, gate_b, gate_scaling, bits, rows, channels)
    up = _rebuilt(up_packed, up_scale, up_zero, up_xa, up_b, up_scaling, bits, rows, channels)
    outputs = _swiglu_grads(grad_h.reshape(rows, channels).float(), gate, up)
    return tuple(t.to(grad_h.dtype).reshape(grad_h.shape) for t in outputs)


def lora_swiglu_forward_reference(gate_base: torch.Tensor, gate_xa: torch.Tensor, gate_b: torch.Tensor,
                                  gate_scaling: float, up_base: torch.Tensor, up_xa: torch.Tensor,
                                  up_b: torch.Tensor, up_scaling: float) -> torch.Tensor:
    channels = gate_base.shape[-1]
    gate = gate_base.reshape(-1, channels).float() + _lora_term(gate_xa, gate_b, gate_scaling)
    up = up_base.reshape(-1, channels).float() + _lora_term(up_xa, up_b, up_scaling)
    return (torch.nn.functional.silu(gate) * up).to(gate_base.dtype).reshape(gate_base.shape)


def lora_gelu_backward_reference(grad_a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                                 zero: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float, bits: int,
                                 approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    channels = grad_a.shape[-1]
    rows = grad_a.numel() // channels
    y = _rebuilt(packed, scale, zero, xa, b, scaling, bits, rows, channels)
    grad_y = torch.ops.aten.gelu_backward(grad_a.reshape(rows, channels).float(), y, approximate=approximate)
    a = torch.nn.functional.gelu(y, approximate=approximate)
    return tuple(t.to(grad_a.dtype).reshape(grad_a.shape) for t in (grad_y, a))


def lora_gelu_forward_reference(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float,
                                approximate: str) -> torch.Tensor:
    y = base.reshape(-1, base.shape[-1]).float() + _lora_term(xa, b, scaling)
    return torch.nn.functional.gelu(y, approximate=approximate).to(base.dtype).reshape(base.shape)


# --- Triton kernels ---------------------------------------------------------------------------------------------

if triton is not None:
    @triton.jit
    def _dequantized_tile(packed_ptr, scale_ptr, zero_ptr, rows, cols, mask, channels, BITS: tl.constexpr):
        """deq(Y_W) on a tile, as quantize.unpack: channel c of a row is in its byte c % W, plane c // W (W the
        row's bytes). The plane and byte are per column, so a row's loads are contiguous runs."""
        width = (channels * BITS + 7) // 8
        plane = cols // width
        byte = rows[:, None].to(tl.int64) * width + (cols - plane * width)[None, :]
        packed = tl.load(packed_ptr + byte, mask=mask, other=0).to(tl.int32)
        code = ((packed >> (plane * BITS)[None, :]) & (2**BITS - 1)).to(tl.float32)
        scale = tl.load(scale_ptr + cols, mask=cols < channels, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + cols, mask=cols < channels, other=0.0).to(tl.float32)
        return (code - zero[None, :]) * scale[None, :]

    @triton.jit
    def _base_tile(base_ptr, rows, cols, mask, channels):
        index = rows[:, None].to(tl.int64) * channels + cols[None, :]
        return tl.load(base_ptr + index, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _lora_tile(xa_ptr, b_ptr, scaling, rows, cols, n_rows, channels, rank, BLOCK_N: tl.constexpr,
                   BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """s (XA) B^T on a tile, over r in steps of BLOCK_K: registers hold one step's operands at any rank (all
        of r at once spilled at rank 256). Past r the operands load as zeros, which add nothing."""
        product = tl.zeros((BLOCK_N, BLOCK_O), dtype=tl.float32)
        for start in range(0, rank, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            xa = tl.load(xa_ptr + rows[:, None].to(tl.int64) * rank + k[None, :],
                         mask=(rows[:, None] < n_rows) & (k[None, :] < rank), other=0.0)
            b_t = tl.load(b_ptr + cols[None, :].to(tl.int64) * rank + k[:, None],
                          mask=(k[:, None] < rank) & (cols[None, :] < channels), other=0.0)
            # fp32 operands (the interpreter multiplies bf16 operands as their raw bits).
            product += tl.dot(xa.to(tl.float32), b_t.to(tl.float32), input_precision=DOT_PRECISION)
        return scaling * product

    @triton.jit
    def _gelu_and_derivative(y, APPROXIMATE_TANH: tl.constexpr):
        if APPROXIMATE_TANH:
            # 0.5 (1 + tanh(u)) = sigmoid(2u) and 1 - tanh(u)^2 = 4 sigmoid(2u) (1 - sigmoid(2u)): no tanh needed,
            # and no cancellation in 1 + tanh(u) for large negative u.
            sqrt_2_over_pi: tl.constexpr = 0.7978845608028654
            sig = tl.sigmoid(2.0 * sqrt_2_over_pi * (y + 0.044715 * y * y * y))
            a = y * sig
            derivative = sig + 2.0 * y * sig * (1.0 - sig) * sqrt_2_over_pi * (1.0 + 3.0 * 0.044715 * y * y)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(y * 0.7071067811865476))
            a = y * cdf
            derivative = cdf + y * tl.exp(-0.5 * y * y) * 0.3989422804014327  # 1 / sqrt(2 pi)
        return a, derivative

    @triton.jit
    def _lora_swiglu_backward_kernel(
            grad_h_ptr, gate_packed_ptr, gate_scale_ptr, gate_zero_ptr, gate_xa_ptr, gate_b_ptr, gate_scaling,
            up_packed_ptr, up_scale_ptr, up_zero_ptr, up_xa_ptr, up_b_ptr, up_scaling,
            grad_gate_ptr, grad_up_ptr, h_ptr, n_rows, channels, gate_rank, up_rank,
            BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
            GATE_DOT_PRECISION: tl.constexpr, UP_DOT_PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < channels)
        gate = _dequantized_tile(gate_packed_ptr, gate_scale_ptr, gate_zero_ptr, rows, cols, mask, channels, BITS)
        gate += _lora_tile(gate_xa_ptr, gate_b_ptr, gate_scaling, rows, cols, n_rows, channels, gate_rank,
                           BLOCK_N, BLOCK_O, BLOCK_K, GATE_DOT_PRECISION)
        up = _dequantized_tile(up_packed_ptr, up_scale_ptr, up_zero_ptr, rows, cols, mask, channels, BITS)
        up += _lora_tile(up_xa_ptr, up_b_ptr, up_scaling, rows, cols, n_rows, channels, up_rank,
                         BLOCK_N, BLOCK_O, BLOCK_K, UP_DOT_PRECISION)
        grad_h = _base_tile(grad_h_ptr, rows, cols, mask, channels)
        sig = tl.sigmoid(gate)
        silu = gate * sig
        index = rows[:, None].to(tl.int64) * channels + cols[None, :]
        out_type = grad_gate_ptr.dtype.element_ty
        tl.store(grad_gate_ptr + index, (grad_h * up * sig * (1.0 + gate * (1.0 - sig))).to(out_type), mask=mask)
        tl.store(grad_up_ptr + index, (grad_h * silu).to(out_type), mask=mask)
        tl.store(h_ptr + index, (silu * up).to(out_type), mask=mask)

    @triton.jit
    def _lora_swiglu_forward_kernel(
            gate_base_ptr, gate_xa_ptr, gate_b_ptr, gate_scaling, up_base_ptr, up_xa_ptr, up_b_ptr, up_scaling,
            h_ptr, n_rows, channels, gate_rank, up_rank,
            BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
            GATE_DOT_PRECISION: tl.constexpr, UP_DOT_PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < channels)
        gate = _base_tile(gate_base_ptr, rows, cols, mask, channels)
        gate += _lora_tile(gate_xa_ptr, gate_b_ptr, gate_scaling, rows, cols, n_rows, channels, gate_rank,
                           BLOCK_N, BLOCK_O, BLOCK_K, GATE_DOT_PRECISION)
        up = _base_tile(up_base_ptr, rows, cols, mask, channels)
        up += _lora_tile(up_xa_ptr, up_b_ptr, up_scaling, rows, cols, n_rows, channels, up_rank,
                         BLOCK_N, BLOCK_O, BLOCK_K, UP_DOT_PRECISION)
        index = rows[:, None].to(tl.int64) * channels + cols[None, :]
        tl.store(h_ptr + index, (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _lora_gelu_backward_kernel(
            grad_a_ptr, packed_ptr, scale_ptr, zero_ptr, xa_ptr, b_ptr, scaling, grad_y_ptr, a_ptr,
            n_rows, channels, rank, BITS: tl.constexpr, APPROXIMATE_TANH: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < channels)
        y = _dequantized_tile(packed_ptr, scale_ptr, zero_ptr, rows, cols, mask, channels, BITS)
        y += _lora_tile(xa_ptr, b_ptr, scaling, rows, cols, n_rows, channels, rank, BLOCK_N, BLOCK_O, BLOCK_K,
                        DOT_PRECISION)
        a, derivative = _gelu_and_derivative(y, APPROXIMATE_TANH)
        grad_a = _base_tile(grad_a_ptr, rows, cols, mask, channels)
        index = rows[:, None].to(tl.int64) * channels + cols[None, :]
        tl.store(grad_y_ptr + index, (grad_a * derivative).to(grad_y_ptr.dtype.element_ty), mask=mask)
        tl.store(a_ptr + index, a.to(a_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _lora_gelu_forward_kernel(
            base_ptr, xa_ptr, b_ptr, scaling, a_ptr, n_rows, channels, rank, APPROXIMATE_TANH: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < channels)
        y = _base_tile(base_ptr, rows, cols, mask, channels)
        y += _lora_tile(xa_ptr, b_ptr, scaling, rows, cols, n_rows, channels, rank, BLOCK_N, BLOCK_O, BLOCK_K,
                        DOT_PRECISION)
        a, _ = _gelu_and_derivative(y, APPROXIMATE_TANH)
        index = rows[:, None].to(tl.int64) * channels + cols[None, :]
        tl.store(a_ptr + index, a.to(a_ptr.dtype.element_ty), mask=mask)

    # A tile of 32 rows x 64 channels over 8 warps, r taken 16 at a time (tl.dot needs every dimension >= 16):
    # with 32 at a time or 4 warps, ptxas spilled the SwiGLU kernels' registers on fp32 factors (fxmem bench ptxas).
    TILE = {"BLOCK_N": 32, "BLOCK_O": 64, "BLOCK_K": 16, "num_warps": 8}
    _HALF = (torch.bfloat16, torch.float16)

    def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
        # Triton launches on the current device, which on a multi-GPU node need not be the tensors'.
        return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

    def _dot_precision(xa: torch.dtype, b: torch.dtype) -> str:
        # tf32 holds bf16/fp16 values exactly, so half factors get exact products on tensor cores; fp32 factors get
        # full fp32 products, as torch's matmul computes them by default.
        return "tf32" if xa in _HALF and b in _HALF else "ieee"

    def _grid(rows: int, channels: int) -> tuple[int, int]:
        return triton.cdiv(rows, TILE["BLOCK_N"]), triton.cdiv(channels, TILE["BLOCK_O"])

    def lora_swiglu_backward_triton(
            grad_h: torch.Tensor, gate_packed: torch.Tensor, gate_scale: torch.Tensor, gate_zero: torch.Tensor,
            gate_xa: torch.Tensor, gate_b: torch.Tensor, gate_scaling: float, up_packed: torch.Tensor,
            up_scale: torch.Tensor, up_zero: torch.Tensor, up_xa: torch.Tensor, up_b: torch.Tensor,
            up_scaling: float, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Triton kernel behind ``lora_swiglu_backward_reference``."""
        grad_h = grad_h.contiguous()
        channels = grad_h.shape[-1]
        rows = grad_h.numel() // channels
        grad_gate, grad_up, h = (torch.empty_like(grad_h) for _ in range(3))
        with _on_device(grad_h):
            _lora_swiglu_backward_kernel[_grid(rows, channels)](
                grad_h, gate_packed, gate_scale.contiguous(), gate_zero.contiguous(), gate_xa.contiguous(),
                gate_b.contiguous(), gate_scaling, up_packed, up_scale.contiguous(), up_zero.contiguous(),
                up_xa.contiguous(), up_b.contiguous(), up_scaling, grad_gate, grad_up, h, rows, channels,
                gate_xa.shape[1], up_xa.shape[1], BITS=bits,
                GATE_DOT_PRECISION=_dot_precision(gate_xa.dtype, gate_b.dtype),
                UP_DOT_PRECISION=_dot_precision(up_xa.dtype, up_b.dtype), **TILE)
        return grad_gate, grad_up, h

    def lora_swiglu_forward_triton(gate_base: torch.Tensor, gate_xa: torch.Tensor, gate_b: torch.Tensor,
                                   gate_scaling: float, up_base: torch.Tensor, up_xa: torch.Tensor,
                                   up_b: torch.Tensor, up_scaling: float) -> torch.Tensor:
        gate_base = gate_base.contiguous()
        channels = gate_base.shape[-1]
        rows = gate_base.numel() // channels
        h = torch.empty_like(gate_base)
        with _on_device(gate_base):
            _lora_swiglu_forward_kernel[_grid(rows, channels)](
                gate_base, gate_xa.contiguous(), gate_b.contiguous(), gate_scaling, up_base.contiguous(),
                up_xa.contiguous(), up_b.contiguous(), up_scaling, h, rows, channels, gate_xa.shape[1],
                up_xa.shape[1], GATE_DOT_PRECISION=_dot_precision(gate_xa.dtype, gate_b.dtype),
                UP_DOT_PRECISION=_dot_precision(up_xa.dtype, up_b.dtype), **TILE)
        return h

    def lora_gelu_backward_triton(grad_a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                                  zero: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float, bits: int,
                                  approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
        grad_a = grad_a.contiguous()
        channels = grad_a.shape[-1]
        rows = grad_a.numel() // channels
        grad_y, a = torch.empty_like(grad_a), torch.empty_like(grad_a)
        with _on_device(grad_a):
            _lora_gelu_backward_kernel[_grid(rows, channels)](
                grad_a, packed, scale.contiguous(), zero.contiguous(), xa.contiguous(), b.contiguous(), scaling,
                grad_y, a, rows, channels, xa.shape[1], BITS=bits, APPROXIMATE_TANH=approximate == "tanh",
                DOT_PRECISION=_dot_precision(xa.dtype, b.dtype), **TILE)
        return grad_y, a

    def lora_gelu_forward_triton(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float,
                                 approximate: str) -> torch.Tensor:
        base = base.contiguous()
        channels = base.shape[-1]
        rows = base.numel() // channels
        a = torch.empty_like(base)
        with _on_device(base):
            _lora_gelu_forward_kernel[_grid(rows, channels)](
                base, xa.contiguous(), b.contiguous(), scaling, a, rows, channels, xa.shape[1],
                APPROXIMATE_TANH=approximate == "tanh", DOT_PRECISION=_dot_precision(xa.dtype, b.dtype), **TILE)
        return a


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the ops run their Triton kernel on ``t``'s device (else their torch reference)."""
    return t.device.type == "cuda" and triton is not None


# --- custom ops -------------------------------------------------------------------------------------------------

@torch.library.custom_op("fxmem::lora_swiglu_backward", mutates_args=())
def lora_swiglu_backward(
        grad_h: torch.Tensor, gate_packed: torch.Tensor, gate_scale: torch.Tensor, gate_zero: torch.Tensor,
        gate_xa: torch.Tensor, gate_b: torch.Tensor, gate_scaling: float, up_packed: torch.Tensor,
        up_scale: torch.Tensor, up_zero: torch.Tensor, up_xa: torch.Tensor, up_b: torch.Tensor, up_scaling: float,
        bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dgate, dL/dup, h) for h = silu(gate) up, gate and up rebuilt from quantized Y_W plus the LoRA term.

    ``grad_h`` is (..., o); each ``*_xa`` is (n, r) with n = grad_h.numel() // o, each ``*_b`` (o, r).
    """
    _check_swiglu_backward(grad_h, gate_packed, gate_scale, gate_zero, gate_xa, gate_b, up_packed, up_scale,
                           up_zero, up_xa, up_b, bits)
    implementation = lora_swiglu_backward_triton if uses_triton(grad_h) else lora_swiglu_backward_reference
    return implementation(grad_h, gate_packed, gate_scale, gate_zero, gate_xa, gate_b, gate_scaling, up_packed,
                          up_scale, up_zero, up_xa, up_b, up_scaling, bits)


def _check_swiglu_backward(grad_h, gate_packed, gate_scale, gate_zero, gate_xa, gate_b, up_packed, up_scale,
                           up_zero, up_xa, up_b, bits) -> None:
    check_bits(bits)
    _check_quantized("gate_", gate_packed, gate_scale, gate_zero, gate_xa, gate_b, grad_h.shape, bits)
    _check_quantized("up_", up_packed, up_scale, up_zero, up_xa, up_b, grad_h.shape, bits)


@lora_swiglu_backward.register_fake
def _(grad_h, gate_packed, gate_scale, gate_zero, gate_xa, gate_b, gate_scaling, up_packed, up_scale, up_zero,
      up_xa, up_b, up_scaling, bits):
    _check_swiglu_backward(grad_h, gate_packed, gate_scale, gate_zero, gate_xa, gate_b, up_packed, up_scale,
                           up_zero, up_xa, up_b, bits)
    return tuple(grad_h.new_empty(grad_h.shape) for _ in range(3))


@torch.library.custom_op("fxmem::lora_swiglu_forward", mutates_args=())
def lora_swiglu_forward(gate_base: torch.Tensor, gate_xa: torch.Tensor, gate_b: torch.Tensor, gate_scaling: float,
                        up_base: torch.Tensor, up_xa: torch.Tensor, up_b: torch.Tensor,
                        up_scaling: float) -> torch.Tensor:
    """h = silu(gate) up with gate = gate_base + s (XA) B^T and up likewise; shapes as ``lora_swiglu_backward``."""
    _check_swiglu_forward(gate_base, gate_xa, gate_b, up_base, up_xa, up_b)
    implementation = lora_swiglu_forward_triton if uses_triton(gate_base) else lora_swiglu_forward_reference
    return implementation(gate_base, gate_xa, gate_b, gate_scaling, up_base, up_xa, up_b, up_scaling)


def _check_swiglu_forward(gate_base, gate_xa, gate_b, up_base, up_xa, up_b) -> None:
    _check_unquantized("gate_", gate_base, gate_xa, gate_b, gate_base.shape)
    _check_unquantized("up_", up_base, up_xa, up_b, gate_base.shape)


@lora_swiglu_forward.register_fake
def _(gate_base, gate_xa, gate_b, gate_scaling, up_base, up_xa, up_b, up_scaling):
    _check_swiglu_forward(gate_base, gate_xa, gate_b, up_base, up_xa, up_b)
    return gate_base.new_empty(gate_base.shape)


@torch.library.custom_op("fxmem::lora_gelu_backward", mutates_args=())
def lora_gelu_backward(grad_a: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                       xa: torch.Tensor, b: torch.Tensor, scaling: float, bits: int,
                       approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dy, a) for a = gelu(y, approximate), y rebuilt from quantized Y_W plus the LoRA term."""
    _check_gelu_backward(grad_a, packed, scale, zero, xa, b, bits, approximate)
    implementation = lora_gelu_backward_triton if uses_triton(grad_a) else lora_gelu_backward_reference
    return implementation(grad_a, packed, scale, zero, xa, b, scaling, bits, approximate)


def _check_gelu_backward(grad_a, packed, scale, zero, xa, b, bits, approximate) -> None:
    check_bits(bits)
    check_approximate(approximate)
    _check_quantized("", packed, scale, zero, xa, b, grad_a.shape, bits)


@lora_gelu_backward.register_fake
def _(grad_a, packed, scale, zero, xa, b, scaling, bits, approximate):
    _check_gelu_backward(grad_a, packed, scale, zero, xa, b, bits, approximate)
    return grad_a.new_empty(grad_a.shape), grad_a.new_empty(grad_a.shape)


@torch.library.custom_op("fxmem::lora_gelu_forward", mutates_args=())
def lora_gelu_forward(base: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, scaling: float,
                      approximate: str) -> torch.Tensor:
    """a = gelu(base + s (XA) B^T, approximate)."""
    _check_gelu_forward(base, xa, b, approximate)
    implementation = lora_gelu_forward_triton if uses_triton(base) else lora_gelu_forward_reference
    return implementation(base, xa, b, scaling, approximate)


def _check_gelu_forward(base, xa, b, approximate) -> None:
    check_approximate(approximate)
    _check_unquantized("", base, xa, b, base.shape)


@lora_gelu_forward.register_fake
def _(base, xa, b, scaling, approximate):
    _check_gelu_forward(base, xa, b, approximate)
    return base.new_empty(base.shape)
