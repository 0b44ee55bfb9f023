"""A LoRA on stacked expert weights, applied per expert as its two small products, torch reference.

``y_e = (x_e a_e) b_e`` for the rows ``x_e`` routed to expert ``e``: rows sorted by expert, ``offsets`` their
cumulative ends, as transformers' grouped matmuls take them. The adapter is never merged into the experts' weights
nor formed beside them. Autograd keeps x and the factors (views of the adapter's parameters: no copy, even where
the adapters are in another dtype than x, since the casts happen inside); backward recomputes ``x_e a_e`` (n x r).
The products run in the factors' dtype, as PEFT runs a LoRA branch in its adapters' dtype. A fast path on CUDA
(``torch._grouped_mm``) is not written yet: the loop over experts is transformers' own fallback's.
"""

from __future__ import annotations

import torch


def _segments(offsets: torch.Tensor) -> list[tuple[int, int]]:
    ends = offsets.tolist()  # one device sync, as transformers' grouped matmul fallback
    return list(zip([0, *ends[:-1]], ends, strict=True))


@torch.library.custom_op("fxmem::grouped_lora", mutates_args=())
def grouped_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, in) rows sorted by expert, a (E, in, r), b (E, r, out), offsets (E,) -> (S, out) in a's dtype; rows
    past the last offset are zero."""
    out = x.new_zeros(x.size(0), b.size(-1), dtype=a.dtype)
    for expert, (start, end) in enumerate(_segments(offsets)):
        if start < end:
            out[start:end] = (x[start:end].to(a.dtype) @ a[expert]) @ b[expert]
    return out


@grouped_lora.register_fake
def _(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.size(0), b.size(-1), dtype=a.dtype)


@torch.library.custom_op("fxmem::grouped_lora_backward", mutates_args=())
def grouped_lora_backward(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                          grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, da, db) of ``grouped_lora``: u = dy_e b_e^T, then da_e = x_e^T u, db_e = (x_e a_e)^T dy_e,
    dx_e = u a_e^T."""
    grad_x, grad_a, grad_b = torch.zeros_like(x), torch.zeros_like(a), torch.zeros_like(b)
    for expert, (start, end) in enumerate(_segments(offsets)):
        if start < end:
            rows, dy = x[start:end].to(a.dtype), grad[start:end].to(a.dtype)
            u = dy @ b[expert].t()
            grad_a[expert] = rows.t() @ u
            grad_b[expert] = (rows @ a[expert]).t() @ dy
            grad_x[start:end] = u @ a[expert].t()
    return grad_x, grad_a, grad_b


@grouped_lora_backward.register_fake
def _(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(a), torch.empty_like(b)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[torch.Tensor, ...],
                   output: torch.Tensor) -> None:
    x, a, b, offsets = inputs
    ctx.save_for_backward(x, a, b, offsets)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    return (*torch.ops.fxmem.grouped_lora_backward(*ctx.saved_tensors, grad), None)


grouped_lora.register_autograd(_backward, setup_context=_setup_context)
