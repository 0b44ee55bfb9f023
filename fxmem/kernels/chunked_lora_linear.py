"""LoRA linears that read one input (an attention's q, k and v projections, or its o projection alone), over chunks of
tokens: their float32 adapter rows and their input gradient's terms never exist whole.

A LoRA linear is PEFT's: ``(x W^T + scale (x A^T) B^T)`` in the promoted dtype, cast back to x's dtype, x cast to
A's dtype for the adapter (PEFT keeps fp32 adapters on a half-precision model), and to W's for the base where
W's differs (a bitsandbytes 4-bit base dequantized for the op: its product in its computation dtype, then cast
back). In backward, as aten runs it, each
linear holds its output gradient again in float32 for the adapter, and d x is a sum of two products per linear
that inductor computes whole before it adds them: at long context, in a block recomputed in backward, these are the
step's largest transients. ``chunked_lora_linears`` runs the linears ``chunk_rows`` tokens at a time in forward and
backward, saves only x for backward (the adapters' gradients need it; the base weights are frozen), and adds each
chunk's terms of d x into one buffer. The LoRA gradients accumulate in float32.

``lora_linear`` is the unchunked torch computation the op is tested against; ``lora_linear_backward`` is one
chunk's backward, shared with the chunked MLP (kernels/chunked_mlp.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor


class LoraLinear(NamedTuple):
    weight: Tensor  # (out, in), frozen
    a: Tensor  # (rank, in)
    b: Tensor  # (out, rank)
    scale: float


def lora_linear(x: Tensor, linear: LoraLinear) -> Tensor:
    base = _base_product(x, linear.weight.t())
    adapter = (x.to(linear.a.dtype) @ linear.a.t()) @ linear.b.t()
    return (base + adapter * linear.scale).to(x.dtype)


def lora_linear_backward(x_adapter: Tensor, grad_out: Tensor, linear: LoraLinear, lora_grads: list[Tensor], *,
                         input_grad: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """d x of ``lora_linear(x, linear)`` as (the base's term in grad_out's dtype, the adapter's in A's dtype), or
    (None, None) without ``input_grad``; adds d A and d B into ``lora_grads``. ``x_adapter``: x cast to A's dtype."""
    adapter_grad = grad_out.to(linear.b.dtype) * linear.scale
    lora_grads[1] += (adapter_grad.t() @ (x_adapter @ linear.a.t())).float()
    grad_xa = adapter_grad @ linear.b
    lora_grads[0] += (grad_xa.t() @ x_adapter).float()
    if not input_grad:
        return None, None
    return _base_product(grad_out, linear.weight), grad_xa @ linear.a


def _base_product(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight in the weight's dtype, in x's: a bitsandbytes 4-bit base computes in its own dtype (its
    ``compute_dtype``) between two casts, on inputs that QLoRA's preparation keeps in float32."""
    if weight.dtype == x.dtype:
        return x @ weight
    return (x.to(weight.dtype) @ weight).to(x.dtype)


def chunked_lora_linears(x: Tensor, linears: Sequence[LoraLinear], chunk_rows: int) -> list[Tensor]:
    """``[lora_linear(x, linear) for linear in linears]``, ``chunk_rows`` tokens at a time. x: (..., in)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    if not linears:
        raise ValueError("no linear given: the op takes one or more LoRA linears of one input")
    for index, linear in enumerate(linears):
        if linear.weight.requires_grad:
            raise ValueError(f"linear {index}'s base weight trains: the chunked linears take frozen base weights "
                             "(a LoRA's)")
        if linear.weight.shape[1] != x.shape[-1]:
            raise ValueError(f"linear {index} takes {linear.weight.shape[1]} features; x has {x.shape[-1]}")
        if linear.a.dtype != linears[0].a.dtype:
            raise ValueError(f"linear {index}'s adapter is {linear.a.dtype}, linear 0's {linears[0].a.dtype}: the "
                             "op casts x to one adapter dtype")
    weights, a, b, scales = (list(field) for field in zip(*linears, strict=True))
    return _chunked_lora_linears(x, weights, a, b, scales, chunk_rows)


def workspace_bytes(rows: int, chunk_rows: int, features: int, widths: Sequence[int], rank: int, element_size: int,
                    *, backward: bool, x_trains: bool = True) -> int:
    """The most bytes the op holds at once beyond its inputs and outputs, for float32 adapters (PEFT's): one chunk's
    rows. Measured (tests/kernels/test_chunked_lora_linear.py), with x in float32 beside each phase where x is
    narrower. Forward, per linear: its base product and x's rank-wide rows, then its base product and three float32
    rows of its width (the adapter's product, its scaled copy, their sum), and a float32 copy of the base product
    where it is narrower. Backward, per linear: its output gradient in float32 and scaled (twice its width in
    float32 where narrower), then the scaled one with the base's and the adapter's terms of d x and the rank-wide
    rows, and from the second linear on, the adapters' running sum of d x in float32 (no term of d x where x does
    not train)."""
    chunk = min(rows, chunk_rows)
    narrower = element_size < 4
    upcast = features * 4 if narrower else 0
    if not backward:
        return chunk * max(max(upcast + rank * 4 + width * element_size,
                               width * (element_size + 3 * 4 + (4 if narrower else 0))) for width in widths)
    if not x_trains:
        return chunk * (upcast + max(max(width * (8 if narrower else 4), (width + rank) * 4) for width in widths))
    return chunk * (upcast + max(
        (features * 4 if index else 0)
        + max(width * (8 if narrower else 4), width * 4 + features * (element_size + 4)) + rank * 4
        for index, width in enumerate(widths)))


@torch.library.custom_op("fxmem::chunked_lora_linears", mutates_args=())
def _chunked_lora_linears(x: Tensor, weights: list[Tensor], a: list[Tensor], b: list[Tensor], scales: list[float],
                          chunk_rows: int) -> list[Tensor]:
    linears = [LoraLinear(*fields) for fields in zip(weights, a, b, scales, strict=True)]
    rows = x.reshape(-1, x.shape[-1])
    outputs = [rows.new_empty(rows.shape[0], linear.weight.shape[0]) for linear in linears]
    for start in range(0, rows.shape[0], chunk_rows):
        for linear, output in zip(linears, outputs, strict=True):
            output[start:start + chunk_rows] = lora_linear(rows[start:start + chunk_rows], linear)
    return [output.reshape(*x.shape[:-1], output.shape[-1]) for output in outputs]


@_chunked_lora_linears.register_fake
def _(x, weights, a, b, scales, chunk_rows):
    return [x.new_empty(*x.shape[:-1], weight.shape[0]) for weight in weights]


@torch.library.custom_op("fxmem::chunked_lora_linears_backward", mutates_args=())
def _chunked_lora_linears_backward(grads: list[Tensor], x: Tensor, weights: list[Tensor], a: list[Tensor],
                                   b: list[Tensor], scales: list[float], chunk_rows: int, x_trains: bool
                                   ) -> list[Tensor]:
    """[d x (empty where x does not train), then d A and d B of each linear]."""
    linears = [LoraLinear(*fields) for fields in zip(weights, a, b, scales, strict=True)]
    rows = x.reshape(-1, x.shape[-1])
    grad_rows = [grad.reshape(-1, grad.shape[-1]) for grad in grads]
    grad_x = rows.new_empty(rows.shape if x_trains else (0, rows.shape[1]))
    lora_grads = [[torch.zeros(t.shape, dtype=torch.float32, device=x.device) for t in (linear.a, linear.b)]
                  for linear in linears]
    for start in range(0, rows.shape[0], chunk_rows):
        end = start + chunk_rows
        _chunk_backward(rows[start:end], [grad[start:end] for grad in grad_rows], linears,
                        grad_x[start:end] if x_trains else None, lora_grads)
    return [grad_x.reshape(x.shape if x_trains else (0,)),
            *(g.to(t.dtype) for linear, pair in zip(linears, lora_grads, strict=True)
              for g, t in zip(pair, (linear.a, linear.b), strict=True))]


def _chunk_backward(x: Tensor, grads: list[Tensor], linears: list[LoraLinear], grad_x: Tensor | None,
                    lora_grads: list[list[Tensor]]) -> None:
    """One chunk: writes its rows of ``grad_x`` (where x trains), adds into the LoRA gradients. A function of its
    own so that its rows are freed before the next chunk's are made."""
    x_adapter = x.to(linears[0].a.dtype)
    adapter_term = None
    for grad, linear, pair in zip(grads, linears, lora_grads, strict=True):
        base, adapter = lora_linear_backward(x_adapter, grad, linear, pair, input_grad=grad_x is not None)
        if grad_x is None:
            continue
        if adapter_term is None:
            grad_x.copy_(base)
            adapter_term = adapter
        else:
            grad_x.add_(base)
            adapter_term += adapter
        del base, adapter  # freed before the next linear's are made
    del x_adapter
    if grad_x is not None:
        grad_x.add_(adapter_term.to(x.dtype))


@_chunked_lora_linears_backward.register_fake
def _(grads, x, weights, a, b, scales, chunk_rows, x_trains):
    return [x.new_empty(x.shape if x_trains else (0,)),
            *(torch.empty_like(t) for pair in zip(a, b, strict=True) for t in pair)]


def _setup_context(ctx, inputs, output) -> None:
    x, weights, a, b, scales, chunk_rows = inputs
    ctx.save_for_backward(x, *weights, *a, *b)
    ctx.count, ctx.scales, ctx.chunk_rows = len(weights), scales, chunk_rows
    ctx.set_materialize_grads(False)  # an output nothing reads gets no gradient, not a buffer of zeros


def _backward(ctx, grads):
    x, *params = ctx.saved_tensors
    n = ctx.count
    read = [i for i, grad in enumerate(grads) if grad is not None]  # the linears whose output backward reaches
    x_trains = ctx.needs_input_grad[0]
    a_grads, b_grads = [None] * n, [None] * n
    grad_x = None
    if read:
        pick = [params[i] for i in read], [params[n + i] for i in read], [params[2 * n + i] for i in read]
        grad_x, *lora = _chunked_lora_linears_backward([grads[i] for i in read], x, *pick,
                                                       [ctx.scales[i] for i in read], ctx.chunk_rows, x_trains)
        for i, a_grad, b_grad in zip(read, lora[0::2], lora[1::2], strict=True):
            a_grads[i], b_grads[i] = a_grad, b_grad
    return grad_x if x_trains else None, [None] * n, a_grads, b_grads, None, None


_chunked_lora_linears.register_autograd(_backward, setup_context=_setup_context)
