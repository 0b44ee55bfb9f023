"""HyC-LoRA's inter-operator compression: rebuild a LoRA linear's output in backward instead of saving it.

A non-linear operator right after a LoRA linear (SwiGLU's SiLU and Hadamard
product, BERT's GELU, RoPE and attention for q/k/v) saves Y = X W^T + s (X A^T) B^T
or values derived from it element by element. This pass tags Y, the LoRA
branch that builds it and every element-wise value derived from it up to the
next matmul, attention or reduction (the epilogue) must-recompute. Torch's
min-cut then saves only what the epilogue is rebuilt from: the frozen product
X W^T, which the quantize pass stores quantized (role lora_base_output), the
rank-r X A^T, which stays exact, and B, a parameter. The quantization error
thus never touches what LoRA learned, and the SiLU output, the Hadamard
product and the rotated q/k are not saved at all.

A LoRA linear with dropout on its input is rebuilt the same way: the rebuild reads
x A^T of the dropped x, saved, and x W^T of x itself; the mask and the dropped x
are replay_dropout's. A LoRA linear whose output feeds
no non-linear operator (o_proj, down_proj: a residual add saves nothing), and,
below 8 bits, one feeding GELU or tanh, whose saved derivative quantizes better
than their input (cost_model.options.rebuild_refusal).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import (
    CONSTANT_FILLS,
    is_replayable_pointwise,
    is_view,
    original_op,
    schema_name,
    storage_base,
    strip,
    users_through_views,
)
from fxmem.analysis.lora import NF4_LINEAR, LoraLinear, find_lora_linears
from fxmem.analysis.meta import LORA_REORDERED
from fxmem.analysis.ops import ACTIVATIONS, NONLINEAR_POINTWISE, is_fused_attention
from fxmem.analysis.roles import eager_attention_operand, rope_trig
from fxmem.cost_model.options import rebuild_refusal
from fxmem.passes.manager import (
    UNCHANGED,
    GraphPass,
    PassResult,
    PipelineState,
    joint_primals,
    pass_result,
    tag_must_recompute,
)

aten = torch.ops.aten
# Non-pointwise ops an epilogue may pass through: RoPE's rotate_half is slice, neg, cat.
_EPILOGUE_SHAPE_OPS = frozenset({aten.cat.default, aten.clone.default})


class LoraReorder(GraphPass):
    name = "lora_reorder"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        params = joint_primals(graph)
        loras = [lora for lora in find_lora_linears(graph, params) if schema_name(lora.base.target) != NF4_LINEAR]
        epilogue = _epilogue(graph, {lora.output for lora in loras}, params)
        kinds: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        linear_consumers = 0
        for lora in loras:
            reach = _reach(lora.output, epilogue)
            kind = _consumer_kind(reach, epilogue)
            if kind is None:
                linear_consumers += 1
                continue
            refusal = rebuild_refusal(kind, state.config)
            if refusal is not None:
                refused[refusal] += 1
                continue
            lora.base.meta[LORA_REORDERED] = kind
            tag_must_recompute([*_lora_branch(lora), *reach])
            kinds[kind] += 1
        if not kinds and not refused:
            return UNCHANGED
        parts = []
        if kinds:
            rebuilt = ", ".join(f"{count}x {kind}" for kind, count in sorted(kinds.items()))
            parts.append(f"{sum(kinds.values())} LoRA output(s) rebuilt in backward from x W and x A ({rebuilt})")
        parts += [f"{count} {refusal}" for refusal, count in refused.items()]
        if linear_consumers:
            parts.append(f"{linear_consumers} feeding no activation, Hadamard product or fused attention left as is")
        return pass_result(bool(kinds), *parts)


def _backward_nodes(graph: Graph) -> set[Node]:
    """Nodes that depend on a tangent: the backward half of the joint graph."""
    backward: set[Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
                i in backward for i in node.all_input_nodes):
            backward.add(node)
    return backward


def _epilogue_op(node: Node) -> bool:
    """A replayable element-wise op, or a view or shape op (none of which draws random numbers)."""
    if is_replayable_pointwise(node) or is_view(node):  # is_view: an item of a split too (a fused q/k/v)
        return True
    return node.op == "call_function" and node.target in _EPILOGUE_SHAPE_OPS


def _free_input(node: Node, params: frozenset[Node]) -> bool:
    """An input an epilogue may read besides LoRA outputs: a parameter, a constant or a RoPE table."""
    return strip(node) in params or node.target in CONSTANT_FILLS or rope_trig(storage_base(node)) is not None


def _epilogue(graph: Graph, outputs: set[Node], params: frozenset[Node]) -> set[Node]:
    """The LoRA outputs and every forward value computed from them alone by element-wise and view ops."""
    backward = _backward_nodes(graph)
    epilogue = set(outputs)
    for node in graph.nodes:  # topological order: a node's inputs are decided before it
        if node in epilogue or node in backward or not _epilogue_op(node):
            continue
        inputs = node.all_input_nodes
        if any(i in epilogue for i in inputs) and all(i in epilogue or _free_input(i, params) for i in inputs):
            epilogue.add(node)
    return epilogue


def _reach(output: Node, epilogue: set[Node]) -> list[Node]:
    """The epilogue nodes computed from ``output``, ``output`` first."""
    found, stack = [output], [output]
    while stack:
        for user in stack.pop().users:
            if user in epilogue and user not in found:
                found.append(user)
                stack.append(user)
    return found


def _consumer_kind(reach: list[Node], epilogue: set[Node]) -> str | None:
    """What non-linear operator reads the output ('silu', 'product', 'q', ...); None if only linear ones."""
    for node in reach:
        name = original_op(node)
        if name in ACTIVATIONS or name in NONLINEAR_POINTWISE:
            return name
    own = set(reach)
    for node in reach:
        if node.target is aten.mul.Tensor and len(node.all_input_nodes) == 2 and all(
                i in epilogue for i in node.all_input_nodes) and not all(i in own for i in node.all_input_nodes):
            return "product"  # a Hadamard product with another LoRA output's epilogue (SwiGLU's up)
    for node in reach:
        for user in users_through_views(node):
            if is_fused_attention(user):
                position = next((i for i, a in enumerate(user.args) if isinstance(a, Node) and a in own), None)
                if position is not None:  # None: it reads the output through ops the epilogue does not replay
                    return "qkv"[position] if position < 3 else None
            operand = eager_attention_operand(user, storage_base(node))
            if operand is not None:
                return operand
    return None


def _lora_branch(lora: LoraLinear) -> list[Node]:
    """(x A^T) B^T, the views and scalings that carry it to the add, and the views of x W^T before the add."""
    nodes = [lora.xab]
    for side in lora.output.args:
        while isinstance(side, Node) and side not in (lora.xab, lora.base):
            nodes.append(side)
            side = next(a for a in side.args if isinstance(a, Node))
    return nodes
