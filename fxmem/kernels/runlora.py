"""A LoRA linear computed in a chosen forward and backward order (RunLoRA), torch reference.

The same formulas as fxmem/cost_model/lora_orders.py, as code: ``lora_forward``
and ``lora_backward`` are what the runlora joint pass inserts into the graph
(as aten ops, traced through these functions) and what ``RunLoraLinear`` runs
eagerly. X A^T is never kept from forward to backward.
"""

from __future__ import annotations

from typing import Any

import torch

from fxmem.cost_model.lora_orders import (
    BACKWARD_ASSOCIATIONS,
    BACKWARD_ORDERS,
    FORWARD_ORDERS,
    SPLIT_DX_BACKWARD_ORDERS,
)
from fxmem.cost_model.matmul_library import cpu_matmul_library
from fxmem.kernels.onednn_matmul import matmul


def lora_forward(order: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, library: str = "aten") -> torch.Tensor:
    """Y = X W^T + s (X A^T) B^T (+ bias) in ``order``, for 2-D ``x``. Sums and the scaling ride on addmm's
    accumulation: no separate element-wise pass over an n x o or o x i tensor. ``library`` runs the product with
    W (fxmem/kernels/onednn_matmul.py); the rank-r products stay aten's.

    Adapters in another dtype than W (PEFT's fp32 adapters on a bf16 model) are computed as PEFT does: the LoRA
    branch and the sum in the adapters' dtype, the result rounded to W's; only forward1 applies then."""
    if order == "forward1":
        base = matmul(x, weight.t(), bias, library=library)
        adapter_dtype = lora_a.dtype  # every .to below is a no-op when it is W's
        return torch.addmm(base.to(adapter_dtype), x.to(adapter_dtype) @ lora_a.t(), lora_b.t(),
                           alpha=scaling).to(base.dtype)
    if order == "forward2":
        _check_foldable(order, weight, lora_a)
        merged = torch.addmm(weight, lora_b, lora_a, alpha=scaling).t()
        return matmul(x, merged, bias, library=library)
    raise ValueError(f"unknown forward order {order!r}; valid orders: {', '.join(FORWARD_ORDERS)}")


def lora_backward(order: str, grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor,
                  lora_b: torch.Tensor, scaling: float, needs: frozenset[str], library: str = "aten"
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dX, dA, dB) for 2-D ``grad_y`` and ``x`` in ``order``; None where ``needs`` lacks "x", "a" or "b".
    ``library`` runs dY's product with W (or W + s B A)."""
    if order not in BACKWARD_ASSOCIATIONS:
        raise ValueError(f"unknown backward order {order!r}; valid orders: {', '.join(BACKWARD_ORDERS)}")
    assoc_a, assoc_b, assoc_x = BACKWARD_ASSOCIATIONS[order]
    if assoc_x == "merged" and "x" in needs:
        _check_foldable(order, weight, lora_a)
    # The LoRA branch's products in the adapters' dtype (no copies when it is W's), as in lora_forward.
    grad_y_lora, x_lora = grad_y.to(lora_a.dtype), x.to(lora_a.dtype)
    cached: dict[str, torch.Tensor] = {}

    def z1() -> torch.Tensor:  # s dY B, n x r
        if "z1" not in cached:
            cached["z1"] = (grad_y_lora @ lora_b) * scaling
        return cached["z1"]

    def xtdy() -> torch.Tensor:  # X^T dY, i x o
        if "xtdy" not in cached:
            cached["xtdy"] = x_lora.t() @ grad_y_lora
        return cached["xtdy"]

    grad_x = grad_a = grad_b = None
    if "a" in needs:
        grad_a = z1().t() @ x_lora if assoc_a == "z1" else (lora_b.t() @ xtdy().t()) * scaling
    if "b" in needs:
        grad_b = ((grad_y_lora.t() @ (x_lora @ lora_a.t())) * scaling if assoc_b == "xa"
                  else (xtdy().t() @ lora_a.t()) * scaling)
    if "x" in needs:
        if assoc_x == "split":
            grad_x_base = matmul(grad_y, weight, library=library)
            grad_x = (torch.addmm(grad_x_base, z1(), lora_a) if grad_x_base.dtype == lora_a.dtype
                      else grad_x_base + (z1() @ lora_a).to(grad_x_base.dtype))
        else:
            grad_x = matmul(grad_y, torch.addmm(weight, lora_b, lora_a, alpha=scaling), library=library)
    return grad_x, grad_a, grad_b


def _check_foldable(order: str, weight: torch.Tensor, lora_a: torch.Tensor) -> None:
    if lora_a.dtype != weight.dtype:
        raise ValueError(f"{order} folds s B A into W, which needs A and B in W's dtype ({weight.dtype}), not "
                         f"{lora_a.dtype}; with adapters in another dtype use forward1 and one of "
                         f"{', '.join(SPLIT_DX_BACKWARD_ORDERS)}")


class RunLoraLinear(torch.autograd.Function):
    """Eager LoRA linear in the given orders; saves X (and the weights), not X A^T. Any leading dims on x.
    ``libraries``: what runs the forward's and the backward's product with W."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                lora_b: torch.Tensor, scaling: float, forward_order: str, backward_order: str,
                libraries: tuple[str, str]) -> torch.Tensor:
        y = lora_forward(forward_order, x.reshape(-1, x.shape[-1]), weight, bias, lora_a, lora_b, scaling,
                         libraries[0])
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
        x, weight, _, lora_a, lora_b, scaling, _, backward_order, libraries = inputs
        ctx.save_for_backward(x, weight, lora_a, lora_b)
        ctx.scaling, ctx.backward_order, ctx.library = scaling, backward_order, libraries[1]

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple:
        x, weight, lora_a, lora_b = ctx.saved_tensors
        wanted = dict(zip(("x", "a", "b"), (ctx.needs_input_grad[i] for i in (0, 3, 4)), strict=True))
        needs = frozenset(name for name, needed in wanted.items() if needed)
        grad_x, grad_a, grad_b = lora_backward(ctx.backward_order, grad_y.reshape(-1, grad_y.shape[-1]),
                                               x.reshape(-1, x.shape[-1]), weight, lora_a, lora_b, ctx.scaling, needs,
                                               ctx.library)
        grad_bias = grad_y.reshape(-1, grad_y.shape[-1]).sum(0) if ctx.needs_input_grad[2] else None
        if grad_x is not None:
            grad_x = grad_x.reshape(x.shape)
        return grad_x, None, grad_bias, grad_a, grad_b, None, None, None, None


def weight_libraries(x: torch.Tensor, weight: torch.Tensor) -> tuple[str, str]:
    """What runs a LoRA linear's products with W, forward (X W^T) and backward (dY W), on x's device: on the CPU
    the library the cost model measured faster for this shape, elsewhere aten's."""
    if x.device.type != "cpu":
        return "aten", "aten"
    rows = x.numel() // x.shape[-1]
    out_features, in_features = weight.shape
    return (cpu_matmul_library(rows, in_features, out_features, b_transposed=True, dtype=weight.dtype),
            cpu_matmul_library(rows, out_features, in_features, b_transposed=False, dtype=weight.dtype))


def runlora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scaling: float, forward_order: str = "forward1",
                   backward_order: str = "backward1") -> torch.Tensor:
    """A LoRA linear (frozen ``weight``) in the given orders; see fxmem/cost_model/lora_orders.py. On the CPU its
    products with W run in the library measured faster there (fxmem/cost_model/matmul_library.py)."""
    if forward_order not in FORWARD_ORDERS:
        raise ValueError(f"unknown forward order {forward_order!r}; valid orders: {', '.join(FORWARD_ORDERS)}")
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(f"unknown backward order {backward_order!r}; valid orders: {', '.join(BACKWARD_ORDERS)}")
    if weight.requires_grad:
        raise ValueError("runlora_linear computes no gradient for the base weight: freeze it (requires_grad=False)")
    return RunLoraLinear.apply(x, weight, bias, lora_a, lora_b, scaling, forward_order, backward_order,
                               weight_libraries(x, weight))
