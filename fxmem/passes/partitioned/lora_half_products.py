"""Run the products of PEFT's fp32 adapters on a bf16 model with bf16 inputs and float32 accumulation.

PEFT keeps the adapters in fp32 on a bf16 model: x is cast to fp32, and the LoRA's products (x A^T, its
product with B, and their backward products) run as fp32 GEMMs, on a GPU's CUDA cores instead of its tensor
cores, a sizeable share of the step (measured: docs/gpu.md). This pass runs each such product as
``mm(a.to(half), b.to(half)).to(float32)``: the operands rounded to the model's dtype (x itself where the operand
is x's cast), the product accumulated in float32, as tensor cores accumulate, and its result rounded
to the model's dtype before it is widened again, so that the graphs around it are unchanged. The adapters, their
gradients and the optimizer's state stay fp32.

Which products: in the forward graph, x A^T and (x A^T) B^T of each LoRA linear (analysis/lora.py) whose factors
are fp32 and whose x is a widening cast of a bf16 tensor (not fp16: its range could overflow where fp32's holds);
in the backward graph, every product that reads one of those factors, x A^T, or the cast. The partitioner gives a
node the same name in both graphs, so the backward's are found by name. Under ``lora_half_products="auto"`` the
products change only on a device with bf16 tensor cores (cost_model/matmul_library.half_tensor_cores: a rule, the
same in every run); "on" changes every one (to measure the fidelity on a machine where it does not pay).

TF32 (fp32 operands rounded to 10 mantissa bits inside the tensor cores) is not offered: torch sets it for every
fp32 product of the process (``torch.backends.cuda.matmul``), not for one product of a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import DTYPE_CASTS, aten, is_view, prims, strip, tensor_val, view_source
from fxmem.analysis.lora import matmul_operands
from fxmem.cost_model.matmul_library import half_tensor_cores
from fxmem.passes.joint.adapter_cast import widening_cast
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState
from fxmem.passes.saved_rewrite import call

# bf16 only: fp16's range (65504) could overflow in a product fp32 holds (a gradient under loss scaling)
HALF = torch.bfloat16


class LoraHalfProducts(GraphPass):
    name = "lora_half_products"
    stage = "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        operands = _lora_operands(state)
        if not operands:
            return UNCHANGED
        products = [(gm, node) for gm in (state.fw, state.bw)
                    for node in gm.graph.find_nodes(op="call_function", target=aten.mm.default)
                    if _lora_product(node, operands)]
        if not products:
            return UNCHANGED
        auto = state.config.lora_half_products == "auto"
        if auto and not half_tensor_cores(tensor_val(products[0][1]).device):
            return UNCHANGED  # 'auto' changes them only on bf16 tensor cores: they stay as PEFT runs them
        for gm, node in products:
            _half_product(gm.graph, node)
        for gm in (state.fw, state.bw):
            gm.graph.eliminate_dead_code()
        reason = "the device has bf16 tensor cores" if auto else "as configured"
        note = (f"{len(products)} LoRA product(s) of fp32 adapters run with bfloat16 inputs and float32 accumulation "
                f"({reason})")
        return PassResult(True, note)


def strip_views(node: object) -> Node:
    return strip(node, casts=False)


@dataclass(frozen=True)
class _Operand:
    """What a LoRA product reads, as the forward graph has it: a node of another graph with its name is the same
    tensor only with its shape and dtype too (a pass may have named a backward node alike)."""

    shape: tuple[str, ...]  # as text: comparing symbolic sizes themselves would add guards
    dtype: torch.dtype


def _lora_product(node: Node, operands: dict[str, _Operand]) -> bool:
    """Whether ``node`` is an fp32 product reading one of the LoRA operands."""
    value = tensor_val(node)
    if value is None or value.dtype != torch.float32:
        return False
    for operand in map(strip_views, node.args):
        known = operands.get(operand.name) if isinstance(operand, Node) else None
        operand_value = tensor_val(operand) if known is not None else None
        if operand_value is not None and (_shape(operand_value), operand_value.dtype) == (known.shape, known.dtype):
            return True
    return False


def _shape(value: torch.Tensor) -> tuple[str, ...]:
    return tuple(map(str, value.shape))


def _lora_operands(state: PipelineState) -> dict[str, _Operand]:
    """Name -> what a LoRA product reads: each LoRA linear's factors, x A^T, and x's cast (the analysis matched the
    LoRA linears on the forward graph)."""
    operands = {}
    for lora in state.analysis.loras if state.analysis is not None else ():
        x_lora, _ = matmul_operands(lora.xa)
        chain = widening_cast(x_lora)
        if not chain:
            continue
        factors = (tensor_val(lora.lora_a), tensor_val(lora.lora_b))
        if tensor_val(chain[-1].args[0]).dtype != HALF or any(f is None or f.dtype != torch.float32 for f in factors):
            continue
        for node in (lora.lora_a, lora.lora_b, lora.xa, chain[-1]):
            value = tensor_val(node)
            operands[node.name] = _Operand(_shape(value), value.dtype)
    return operands


def _half_product(graph: Graph, node: Node) -> None:
    with graph.inserting_before(node):
        product = call(graph, aten.mm.default, tuple(_in_half(graph, operand) for operand in node.args))
        wide = call(graph, prims.convert_element_type.default, (product, torch.float32))
    node.replace_all_uses_with(wide)
    graph.erase_node(node)


def _in_half(graph: Graph, operand: Node) -> Node:
    """``operand`` in bf16: the views of a widening cast of a bf16 tensor taken of that tensor itself (no copy), any
    other operand cast."""
    views, source = [], operand
    while is_view(source) and source.target is not None and view_source(source) is source.args[0]:
        views.append(source)
        source = source.args[0]
    if source.target in DTYPE_CASTS and tensor_val(source.args[0]).dtype == HALF:
        rebuilt = source.args[0]
        for view in reversed(views):
            rebuilt = call(graph, view.target, (rebuilt, *view.args[1:]), kwargs=dict(view.kwargs))
        return rebuilt
    return call(graph, prims.convert_element_type.default, (operand, HALF))
