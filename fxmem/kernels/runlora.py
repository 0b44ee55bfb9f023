"""A LoRA linear computed in a chosen forward and backward order (RunLoRA), torch reference.

The orders whose FLOPs fxmem/cost_model/lora_orders.py counts, as code: ``lora_forward``
and ``lora_backward`` are what the runlora joint pass inserts into the graph
(as aten ops, traced through these functions) and what ``RunLoraLinear`` runs
eagerly. X A^T is never kept from forward to backward.
"""

from __future__ import annotations

from typing import Any

import torch

from fxmem.kernels.onednn_matmul import MATMUL_LIBRARIES, matmul

FORWARD_ORDERS = ("forward1", "forward2")
BACKWARD_ORDERS = tuple(f"backward{k}" for k in range(1, 9))
GRADIENTS = ("x", "a", "b")

# How each backward order associates dA, dB and dX (RunLoRA, Appendix A).
#   dA: "z1"  X^T (dY B)        "xtdy"  (X^T dY) B
#   dB: "xa"  (X A^T)^T dY       "xtdy"  A (X^T dY)
#   dX: "split"  dY W + (dY B) A   "merged"  dY (W + s B A)
BACKWARD_ASSOCIATIONS: dict[str, tuple[str, str, str]] = {
    "backward1": ("z1", "xa", "split"),
    "backward2": ("z1", "xtdy", "split"),
    "backward3": ("xtdy", "xtdy", "split"),
    "backward4": ("xtdy", "xtdy", "merged"),
    "backward5": ("z1", "xa", "merged"),
    "backward6": ("xtdy", "xa", "split"),
    "backward7": ("xtdy", "xa", "merged"),
    "backward8": ("z1", "xtdy", "merged"),
}
# The backward orders that leave s B A out of W: all a layer that cannot fold it has.
SPLIT_DX_BACKWARD_ORDERS = tuple(order for order in BACKWARD_ORDERS if BACKWARD_ASSOCIATIONS[order][2] == "split")


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


def runlora_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, scaling: float, forward_order: str = "forward1",
                   backward_order: str = "backward1", libraries: tuple[str, str] = ("aten", "aten")) -> torch.Tensor:
    """A LoRA linear (frozen ``weight``) in the given orders; see fxmem/cost_model/lora_orders.py. ``libraries`` run
    its products with W in forward and backward (fxmem.cost_model.matmul_library.weight_libraries measures which
    is faster on the CPU)."""
    if forward_order not in FORWARD_ORDERS:
        raise ValueError(f"unknown forward order {forward_order!r}; valid orders: {', '.join(FORWARD_ORDERS)}")
    if backward_order not in BACKWARD_ORDERS:
        raise ValueError(f"unknown backward order {backward_order!r}; valid orders: {', '.join(BACKWARD_ORDERS)}")
    if weight.requires_grad:
        raise ValueError("runlora_linear computes no gradient for the base weight: freeze it (requires_grad=False)")
    unknown = [library for library in libraries if library not in MATMUL_LIBRARIES]
    if len(libraries) != 2 or unknown:
        raise ValueError(f"libraries takes two of {', '.join(MATMUL_LIBRARIES)} (forward, backward); got {libraries!r}")
    return RunLoraLinear.apply(x, weight, bias, lora_a, lora_b, scaling, forward_order, backward_order, libraries)
