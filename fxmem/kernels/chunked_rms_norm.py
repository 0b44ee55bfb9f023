"""RMSNorm as HF's Llama family writes it, over chunks of tokens: its float32 intermediates never exist whole.

``weight * (u * rsqrt(mean(u**2, -1) + eps)).to(x.dtype)``, ``u = x.to(torch.float32)``, upcasts a half-precision
x to float32: each float32 intermediate takes twice x's bytes, and its backward, as aten runs it, holds five of
them at once (the upcast input, the normalized input, and their gradients). At long context, in a block recomputed
in backward, they are the step's largest transients. ``chunked_rms_norm`` runs the norm ``chunk_rows`` tokens at a time in
forward and backward, saves only x (what the norm's backward saves anyway, besides one statistic per row) and
recomputes each chunk's statistic in backward. The gradients are the same sums as torch's in another order; the
weight's gradient, where it trains, accumulates in float32.

``rms_norm_reference`` is the unchunked torch computation the op is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    upcast = x.to(torch.float32)
    normalized = upcast * torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normalized.to(x.dtype)


def chunked_rms_norm(x: Tensor, weight: Tensor, eps: float, chunk_rows: int) -> Tensor:
    """``rms_norm_reference`` ``chunk_rows`` tokens at a time. x: (..., hidden); weight: (hidden,)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"the weight must be one value per channel, shape ({x.shape[-1]},); got "
                         f"{tuple(weight.shape)}")
    return _chunked_rms_norm(x, weight, eps, chunk_rows)


def workspace_bytes(rows: int, chunk_rows: int, hidden: int, element_size: int, *, backward: bool) -> int:
    """The most bytes the op holds at once beyond its inputs and outputs (and a few values per row), for a frozen
    weight in x's dtype (as HF loads a norm): one chunk's rows. Measured (tests/kernels/test_chunked_rms_norm.py):
    the float32 upcast of x where x is narrower, and besides it, forward, the float32 normalized rows, their cast to
    x's dtype and their product with the weight; backward, two float32 rows (the gradient reaching the normalized
    rows, and its product with x)."""
    chunk = min(rows, chunk_rows)
    upcast, cast = (0, 0) if element_size == 4 else (4, element_size)
    if backward:
        return chunk * hidden * (upcast + 2 * 4)
    return chunk * hidden * (upcast + 4 + cast + element_size)


def _normalized(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x in float32, 1 / rms per row)."""
    upcast = x.to(torch.float32)
    return upcast, torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps)


@torch.library.custom_op("fxmem::chunked_rms_norm", mutates_args=())
def _chunked_rms_norm(x: Tensor, weight: Tensor, eps: float, chunk_rows: int) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
    for start in range(0, rows.shape[0], chunk_rows):
        out[start:start + chunk_rows] = rms_norm_reference(rows[start:start + chunk_rows], weight, eps)
    return out.reshape(x.shape)


@_chunked_rms_norm.register_fake
def _(x, weight, eps, chunk_rows):
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))


@torch.library.custom_op("fxmem::chunked_rms_norm_backward", mutates_args=())
def _chunked_rms_norm_backward(grad_out: Tensor, x: Tensor, weight: Tensor, eps: float, chunk_rows: int,
                               x_trains: bool, weight_trains: bool) -> tuple[Tensor, Tensor]:
    """(d x, d weight); each empty where its input does not train."""
    rows, grad_rows = x.reshape(-1, x.shape[-1]), grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = rows.new_empty(rows.shape if x_trains else (0, rows.shape[1]))
    grad_weight = torch.zeros(weight.shape if weight_trains else (0,), dtype=torch.float32, device=x.device)
    for start in range(0, rows.shape[0], chunk_rows):
        end = start + chunk_rows
        _chunk_backward(rows[start:end], grad_rows[start:end], weight, eps, grad_x[start:end] if x_trains else None,
                        grad_weight if weight_trains else None)
    return grad_x.reshape(x.shape if x_trains else (0,)), grad_weight.to(weight.dtype)


def _chunk_backward(x: Tensor, grad_out: Tensor, weight: Tensor, eps: float, grad_x: Tensor | None,
                    grad_weight: Tensor | None) -> None:
    """One chunk: writes its rows of ``grad_x``, adds into ``grad_weight`` (either None: not wanted). A function of
    its own so that its float32 rows are freed before the next chunk's are made."""
    upcast, rstd = _normalized(x, eps)
    if grad_weight is not None:  # weight * normalized: as torch, the product in the output's dtype
        grad_weight += (grad_out * (upcast * rstd).to(x.dtype)).sum(0, dtype=torch.float32)
    if grad_x is None:
        return
    # as torch: the gradient reaching the cast to x's dtype is rounded to it, then upcast
    grad_normalized = (grad_out * weight).to(x.dtype).to(torch.float32)
    # d/dx of x * rstd(x), rstd = (mean(x**2) + eps)^-1/2: g * rstd - x * rstd**3 * mean(g * x)
    row_dot = (grad_normalized * upcast).mean(-1, keepdim=True)
    grad_normalized.mul_(rstd)
    grad_normalized.addcmul_(upcast, row_dot * rstd.pow(3), value=-1)  # upcast is x itself for a float32 x
    grad_x.copy_(grad_normalized)


@_chunked_rms_norm_backward.register_fake
def _(grad_out, x, weight, eps, chunk_rows, x_trains, weight_trains):
    return x.new_empty(x.shape if x_trains else (0,)), weight.new_empty(weight.shape if weight_trains else (0,))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, eps, chunk_rows = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.chunk_rows = eps, chunk_rows


def _backward(ctx, grad_out):
    x, weight = ctx.saved_tensors
    x_trains, weight_trains = ctx.needs_input_grad[:2]
    grad_x, grad_weight = _chunked_rms_norm_backward(grad_out, x, weight, ctx.eps, ctx.chunk_rows, x_trains,
                                                     weight_trains)
    return grad_x if x_trains else None, grad_weight if weight_trains else None, None, None


_chunked_rms_norm.register_autograd(_backward, setup_context=_setup_context)
