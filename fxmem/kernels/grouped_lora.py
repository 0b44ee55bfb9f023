"""A LoRA on stacked expert weights, applied per expert as its two small products, torch reference.

``y_e = (x_e a_e) b_e`` for the rows ``x_e`` routed to expert ``e``: rows sorted by expert, ``offsets`` their
cumulative ends, as transformers' grouped matmuls take them. The adapter is never merged into the experts' weights
nor formed beside them. Autograd keeps x and the factors (views of the adapter's parameters: no copy, even where
the adapters are in another dtype than x, since the casts happen inside); backward recomputes ``x_e a_e`` (n x r).
The products run in the factors' dtype, as PEFT runs a LoRA branch in its adapters' dtype.

Two paths, tested against each other: ``torch._grouped_mm`` (one call per product over every expert, no device
sync), where it takes the operands (``grouped_mm_dtype``); else the reference, a loop over the experts
(transformers' own fallback's).
"""

from __future__ import annotations

import torch


def _segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()  # one device sync, as transformers' grouped matmul fallback
    return list(zip([0, *ends[:-1]], ends, strict=True))


def grouped_mm_dtype(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor
                     ) -> torch.dtype | None:
    """The dtype ``torch._grouped_mm`` runs the products in, None where it does not apply. It needs int32 offsets
    and every matrix's rows 16-byte aligned. On CPU: the factors' dtype. On CUDA (compute capability 8.0 or newer)
    bf16 only: bf16 rows, the factors cast to bf16 (PEFT's fp32 adapters), as PEFT casts them to a bf16 model's
    dtype before it folds them into the experts' weights."""
    if not hasattr(torch, "_grouped_mm") or offsets.dtype != torch.int32:
        return None
    dtype = a.dtype
    if x.is_cuda:
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device) < (8, 0):
            return None
        dtype = torch.bfloat16
    size = torch.empty((), dtype=dtype).element_size()
    return dtype if all(n * size % 16 == 0 for n in (a.size(1), a.size(2), b.size(2))) else None


def _grouped(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(rows.contiguous(), weights.contiguous(), offs=offsets)


def _per_expert_sum(left: torch.Tensor, right: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(E, k, n): left_e^T right_e over each expert's rows of left (S, k) and right (S, n). The rows are padded
    to a multiple of 8 with zero rows past the last offset, which no expert reads: left^T's rows must be 16-byte
    aligned too."""
    pad = -left.size(0) % 8
    left, right = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (left, right))
    return torch._grouped_mm(left.t().contiguous(), right.contiguous(), offs=offsets)


def grouped_lora_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor
                           ) -> torch.Tensor:
    out = x.new_zeros(x.size(0), b.size(-1), dtype=a.dtype)
    for expert, (start, end) in enumerate(_segments(offsets)):
        if start < end:
            out[start:end] = (x[start:end].to(a.dtype) @ a[expert]) @ b[expert]
    return out


@torch.library.custom_op("fxmem::grouped_lora", mutates_args=())
def grouped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, in) rows sorted by expert, a (E, in, r), b (E, r, out), offsets (E,) -> (S, out) in a's dtype. Every row
    belongs to an expert (offsets[-1] == S): no expert-parallel sentinel rows."""
    dtype = grouped_mm_dtype(x, a, b, offsets)
    if dtype is None:
        return grouped_lora_reference(x, a, b, offsets)
    return _grouped(_grouped(x.to(dtype), a.to(dtype), offsets), b.to(dtype), offsets).to(a.dtype)


@grouped_lora.register_fake
def _(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.size(0), b.size(-1), dtype=a.dtype)


def grouped_lora_backward_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                                    grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # contiguous, as the fast path's and the fake's
    grad_x, grad_a, grad_b = (t.new_zeros(t.shape) for t in (x, a, b))
    for expert, (start, end) in enumerate(_segments(offsets)):
        if start < end:
            rows, dy = x[start:end].to(a.dtype), grad[start:end].to(a.dtype)
            u = dy @ b[expert].t()
            grad_a[expert] = rows.t() @ u
            grad_b[expert] = (rows @ a[expert]).t() @ dy
            grad_x[start:end] = u @ a[expert].t()
    return grad_x, grad_a, grad_b


@torch.library.custom_op("fxmem::grouped_lora_backward", mutates_args=())
def grouped_lora_backward(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                          grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, da, db) of ``grouped_lora``: u = dy_e b_e^T, then da_e = x_e^T u, db_e = (x_e a_e)^T dy_e,
    dx_e = u a_e^T."""
    dtype = grouped_mm_dtype(x, a, b, offsets)
    if dtype is None:
        return grouped_lora_backward_reference(x, a, b, offsets, grad)
    rows, dy, a_, b_ = x.to(dtype), grad.to(dtype), a.to(dtype), b.to(dtype)
    u = _grouped(dy, b_.transpose(1, 2), offsets)
    grad_x = _grouped(u, a_.transpose(1, 2), offsets).to(x.dtype)
    grad_a = _per_expert_sum(rows, u, offsets).to(a.dtype)
    return grad_x, grad_a, _per_expert_sum(_grouped(rows, a_, offsets), dy, offsets).to(b.dtype)


@grouped_lora_backward.register_fake
def _(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, ...],
                   output: torch.Tensor) -> None:
    x, a, b, offsets = inputs
    ctx.save_for_backward(x, a, b, offsets)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    return (*torch.ops.fxmem.grouped_lora_backward(*ctx.saved_tensors, grad), None)


grouped_lora.register_autograd(_backward, setup_context=_setup_context)
