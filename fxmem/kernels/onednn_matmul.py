"""fp32 matrix products through oneDNN on the CPU, for CPUs where aten's BLAS (MKL) is the slower library.

aten runs a CPU fp32 ``mm`` through MKL, which on AMD CPUs takes a generic
code path, where oneDNN's AVX-512 kernels can be the faster (measured:
docs/cost_model.md). Both are plain fp32 products (no reduced-precision
accumulation), so the results agree to float rounding. Which library is faster is a property of the machine, so
fxmem/cost_model/matmul_library.py measures it per shape rather than assuming
it; this file is the product itself and its torch reference (aten's ``mm``).

``onednn_mm`` is a custom op so that inductor keeps it as one extern call
(its own lowering of oneDNN's linear wants a frozen constant weight).
"""

from __future__ import annotations

import torch

# What a graph node or tensor needs for oneDNN's fp32 product to apply.
ONEDNN_DTYPES = (torch.float32,)
MATMUL_LIBRARIES = ("aten", "onednn")


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def onednn_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True where ``onednn_mm(a, b)`` runs: 2-D fp32 CPU operands with a row- or column-major ``b``."""
    return (onednn_available() and a.dim() == 2 and b.dim() == 2 and a.device.type == "cpu"
            and b.device.type == "cpu" and a.dtype in ONEDNN_DTYPES and b.dtype == a.dtype
            and (b.is_contiguous() or b.t().is_contiguous()))


@torch.library.custom_op("fxmem::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` (+ ``bias`` on every row) by oneDNN; ``b`` may be a transposed view (a frozen W^T). aten's
    product for operands oneDNN cannot take (a compiled graph may hand over other strides than it was traced with)."""
    if not onednn_applies(a, b):
        return onednn_mm_reference(a, b, bias)
    # oneDNN's linear computes a @ weight^T with weight (out, in): b^T is that weight, in either memory order.
    return torch.ops.mkldnn._linear_pointwise(a, b.t(), bias, "none", [], "")


@onednn_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


ONEDNN_MM = torch.ops.fxmem.onednn_mm.default  # the graph target


def onednn_mm_reference(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """aten's product: what ``onednn_mm`` must equal to float rounding."""
    return a @ b if bias is None else torch.addmm(bias, a, b)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, *, library: str = "aten"
           ) -> torch.Tensor:
    """``a @ b`` (+ ``bias``) by ``library`` ("aten" or "onednn"); aten's where oneDNN cannot run it."""
    if library not in MATMUL_LIBRARIES:
        raise ValueError(f"unknown matmul library {library!r}; valid libraries: {', '.join(MATMUL_LIBRARIES)}")
    if library == "onednn":
        return onednn_mm(a, b, bias)
    return onednn_mm_reference(a, b, bias)
