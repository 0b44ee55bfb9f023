"""Run each CPU fp32 matrix product of the forward and backward graphs in the library measured faster here.

With RunLoRA on, a LoRA linear's time on the CPU is mostly its two products
with the frozen W (X W^T, dY W): the orders only move the rank-r work around
them. aten runs those through MKL, which on some CPUs (AMD) is the slower
library; fxmem/cost_model/matmul_library.py measures aten's against oneDNN's
for each product shape and this pass swaps in fxmem::onednn_mm where oneDNN
won (fxmem/kernels/onednn_matmul.py). Same fp32 product, so gradients agree to
float rounding. Products it cannot hand over are left to aten: other dtypes or
devices, a transposed left operand (weight gradients), a bias that is not one
per output column, addmm's alpha/beta.
"""

from __future__ import annotations

from torch.fx import Graph, Node

from fxmem.analysis.graph import aten, hint, tensor_val
from fxmem.cost_model.matmul_library import cpu_matmul_library
from fxmem.kernels.onednn_matmul import ONEDNN_MM, onednn_applies
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState
from fxmem.passes.saved_rewrite import call

PRODUCTS = (aten.mm.default, aten.addmm.default)


class OnednnMatmul(GraphPass):
    name = "onednn_matmul"
    stage = "partitioned"
    speed_only = True

    def run(self, state: PipelineState) -> PassResult:
        moved = total = 0
        for gm in (state.fw, state.bw):
            products = [node for node in gm.graph.nodes if node.op == "call_function" and node.target in PRODUCTS]
            total += len(products)
            for node in products:
                operands = _operands(node)
                moved += operands is not None and _swap_if_faster(gm.graph, node, *operands)
            gm.graph.eliminate_dead_code()
        if not moved:
            return UNCHANGED
        note = f"{moved} of {total} CPU matrix product(s) run by oneDNN (measured faster than aten's here)"
        return PassResult(True, note)


def _operands(node: Node) -> tuple[Node, Node, Node | None] | None:
    """(a, b, bias) of ``a @ b`` (+ bias) where oneDNN can run it; None elsewhere."""
    if node.kwargs:  # addmm's alpha and beta are keyword arguments
        return None
    if node.target == aten.mm.default:
        a, b = node.args
        bias = None
    elif node.target == aten.addmm.default and len(node.args) == 3:
        bias, a, b = node.args
    else:
        return None
    a_val, b_val = tensor_val(a), tensor_val(b)
    if a_val is None or b_val is None or not onednn_applies(a_val, b_val) or not a_val.is_contiguous():
        return None
    if bias is not None:
        bias_val = tensor_val(bias)
        if (bias_val is None or bias_val.dim() != 1 or bias_val.shape[0] != b_val.shape[1]
                or bias_val.dtype != a_val.dtype):
            return None
    return a, b, bias


def _swap_if_faster(graph: Graph, node: Node, a: Node, b: Node, bias: Node | None) -> bool:
    a_val, b_val = tensor_val(a), tensor_val(b)
    rows, inner = (hint(size) for size in a_val.shape)
    library = cpu_matmul_library(rows, inner, hint(b_val.shape[1]), b_transposed=not b_val.is_contiguous(),
                                 dtype=a_val.dtype)
    if library != "onednn":
        return False
    with graph.inserting_before(node):
        product = call(graph, ONEDNN_MM, (a, b, bias))
    node.replace_all_uses_with(product)
    return True
