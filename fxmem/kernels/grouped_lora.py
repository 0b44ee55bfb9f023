"""A LoRA on stacked expert weights, applied per expert as its two small products, torch reference.

``y_e = (x_e a_e) b_e`` for the rows ``x_e`` routed to expert ``e``: rows sorted by expert, ``offsets`` their
cumulative ends, as transformers' grouped matmuls take them. The adapter is never merged into the experts' weights
nor formed beside them. Autograd keeps x and the factors (views of the adapter's parameters: no copy, even where
the adapters are in another dtype than x, since the casts happen inside). The products run in the factors' dtype,
as PEFT runs a LoRA branch in its adapters' dtype.

Backward runs one of RunLoRA's orders that leave the adapter out of the weights (``SPLIT_DX_BACKWARD_ORDERS``):
dA and dB each from the rank-r products (``dy_e b_e^T``, the recomputed ``x_e a_e``) or from ``x_e^T dy_e`` (in x
out per expert, cheaper only where in and out are under about twice the rank). Autograd's runs ``AUTO``: the order
``choose_backward_order`` picks for the rows of this call, when it runs (so under dynamic shapes too), which
``fxmem.peft_lora`` sets to the cost model's choice (kernels do not import the cost model).

Two paths, tested against each other: ``torch._grouped_mm`` (one call per product over every expert, no device
sync), where it takes the operands (``grouped_mm_dtype``); else the reference, a loop over the experts
(transformers' own fallback's).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fxmem.kernels.runlora import BACKWARD_ASSOCIATIONS, SPLIT_DX_BACKWARD_ORDERS

AUTO = "auto"


def _first_order(rows: int, in_features: int, out_features: int, rank: int, dtype: torch.dtype,
                 adapter_dtype: torch.dtype) -> str:
    return "backward1"


# (rows per expert, in, out, rank, x's dtype, the factors' dtype) -> a SPLIT_DX_BACKWARD_ORDERS order: what AUTO runs
choose_backward_order: Callable[[int, int, int, int, torch.dtype, torch.dtype], str] = _first_order


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


def _associations(order: str, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[str, str]:
    """How ``order`` (AUTO: ``choose_backward_order``'s for these sizes) computes dA ("z1": x^T (dy b^T); "xtdy":
    (x^T dy) b^T) and dB ("xa": (x a)^T dy; "xtdy": a^T (x^T dy)); dX is always (dy b^T) a^T."""
    if order == AUTO:
        experts, in_features, rank = a.shape
        order = choose_backward_order(max(1, -(-x.size(0) // experts)), in_features, b.size(-1), rank, x.dtype,
                                      a.dtype)
    if order not in SPLIT_DX_BACKWARD_ORDERS:
        raise ValueError(f"backward order {order!r} is not one a grouped LoRA runs: valid orders (RunLoRA's that keep "
                         f"the adapter out of the weights): {', '.join(SPLIT_DX_BACKWARD_ORDERS)}, or {AUTO!r}")
    d_a, d_b, _ = BACKWARD_ASSOCIATIONS[order]
    return d_a, d_b


def grouped_lora_backward_reference(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                                    grad: torch.Tensor, backward_order: str = AUTO
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d_a, d_b = _associations(backward_order, x, a, b)
    # contiguous, as the fast path's and the fake's
    grad_x, grad_a, grad_b = (t.new_zeros(t.shape) for t in (x, a, b))
    for expert, (start, end) in enumerate(_segments(offsets)):
        if start < end:
            rows, dy = x[start:end].to(a.dtype), grad[start:end].to(a.dtype)
            u = dy @ b[expert].t()
            xtdy = rows.t() @ dy if "xtdy" in (d_a, d_b) else None
            grad_a[expert] = rows.t() @ u if d_a == "z1" else xtdy @ b[expert].t()
            grad_b[expert] = (rows @ a[expert]).t() @ dy if d_b == "xa" else a[expert].t() @ xtdy
            grad_x[start:end] = u @ a[expert].t()
    return grad_x, grad_a, grad_b


@torch.library.custom_op("fxmem::grouped_lora_backward", mutates_args=())
def grouped_lora_backward(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                          grad: torch.Tensor, backward_order: str = AUTO
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, da, db) of ``grouped_lora`` in ``backward_order`` (see ``_associations``)."""
    d_a, d_b = _associations(backward_order, x, a, b)
    dtype = grouped_mm_dtype(x, a, b, offsets)
    if dtype is None:
        return grouped_lora_backward_reference(x, a, b, offsets, grad, backward_order)
    rows, dy, a_, b_ = x.to(dtype), grad.to(dtype), a.to(dtype), b.to(dtype)
    u = _grouped(dy, b_.transpose(1, 2), offsets)
    grad_x = _grouped(u, a_.transpose(1, 2), offsets).to(x.dtype)
    xtdy = _per_expert_sum(rows, dy, offsets) if "xtdy" in (d_a, d_b) else None
    grad_a = _per_expert_sum(rows, u, offsets) if d_a == "z1" else torch.bmm(xtdy, b_.transpose(1, 2))
    grad_b = (_per_expert_sum(_grouped(rows, a_, offsets), dy, offsets) if d_b == "xa"
              else torch.bmm(a_.transpose(1, 2), xtdy))
    return grad_x, grad_a.to(a.dtype), grad_b.to(b.dtype)


@grouped_lora_backward.register_fake
def _(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor,
      backward_order: str = AUTO) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, ...],
                   output: torch.Tensor) -> None:
    x, a, b, offsets = inputs
    ctx.save_for_backward(x, a, b, offsets)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    return (*torch.ops.fxmem.grouped_lora_backward(*ctx.saved_tensors, grad), None)


grouped_lora.register_autograd(_backward, setup_context=_setup_context)
