"""Find LoRA linears in an aten graph by structure: y = x W^T + s * (x A^T) B^T.

The match uses only data flow and shapes (a rank-r matmul pair on the same input
as a frozen matmul, joined by an add), so it holds for PEFT's layers, a plain
module written by hand, and any architecture. A matmul may also be
fxmem::nf4_linear, whose weight is its packed NF4 operand: LoQT's layers
(fxmem.train.loqt) are this pattern with a frozen A (P) or B (P) and NF4 weights.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from torch.fx import Graph, Node

from fxmem.analysis.graph import (
    aten,
    hint,
    module_path,
    schema_name,
    storage_base,
    strip,
    tensor_val,
    users_through_views,
    walk_back,
)

MATMULS = frozenset({aten.mm.default, aten.addmm.default})
# x @ deq(W)^T with W stored NF4 (operands: x, packed W), by name: analysis registers no op (fxmem.kernels does).
NF4_LINEAR = "fxmem::nf4_linear"
# Meta key the lora_reorder pass sets on a LoRA linear's frozen product x W^T when the layer's output is rebuilt
# in backward from it: the non-linear consumer it feeds ('silu', 'gelu', 'product', 'q', 'k', 'v').
LORA_REORDERED = "fxmem_lora_reorder"


@dataclass(frozen=True)
class LoraLinear:
    module: str
    x: Node  # input of the frozen matmul
    base: Node  # the frozen matmul x W^T (mm or addmm)
    xa: Node  # x A^T, rank r
    xab: Node  # (x A^T) B^T
    output: Node  # the add that joins the frozen and the LoRA branch
    weight: Node
    lora_a: Node
    lora_b: Node
    rank: int
    scaling: float  # the constant the LoRA branch is multiplied by (1.0 if none)
    dropout: bool  # the LoRA branch reads a dropout of x, not x itself


def is_linear_product(node: Node) -> bool:
    """One of a LoRA linear's three products: a matmul, or fxmem::nf4_linear."""
    return node.target in MATMULS or schema_name(node.target) == NF4_LINEAR


def matmul_operands(node: Node) -> tuple[Node, Node]:
    """The two matrices of mm/bmm, or of addmm/baddbmm (whose first argument is the added term)."""
    if node.target in (aten.addmm.default, aten.baddbmm.default):
        return node.args[1], node.args[2]
    return node.args[0], node.args[1]


def param_source(node: object, params: frozenset[Node]) -> Node | None:
    source = strip(node)
    return source if source in params else None


def find_lora_linears(graph: Graph, params: frozenset[Node]) -> list[LoraLinear]:
    found = []
    for xa in graph.nodes:
        if xa.op == "call_function" and is_linear_product(xa):
            match = _match_from_xa(xa, params)
            if match is not None:
                found.append(match)
    return found


def _match_from_xa(xa: Node, params: frozenset[Node]) -> LoraLinear | None:
    x_lora, a_t = matmul_operands(xa)
    lora_a = param_source(a_t, params)
    val = tensor_val(xa)
    if lora_a is None or val is None or val.dim() != 2:
        return None
    rank = hint(val.shape[-1])
    in_features = hint(tensor_val(x_lora).shape[-1])
    for xab in users_through_views(xa):
        if not is_linear_product(xab):
            continue
        lhs, b_t = matmul_operands(xab)
        lora_b = param_source(b_t, params)
        # The bottleneck is on the input side; a LoRA on a narrow head (2 classes, r=8) has r > out.
        if lora_b is None or storage_base(lhs) is not xa or not rank < in_features:
            continue
        joined = _follow_to_add(xab)
        if joined is None:
            continue
        output, lora_side, scaling = joined
        base_side = output.args[0] if output.args[1] is lora_side else output.args[1]
        base = strip(base_side, casts=False)
        if not (isinstance(base, Node) and is_linear_product(base)):
            continue
        x_base, w_t = matmul_operands(base)
        weight = param_source(w_t, params)
        if weight is None or weight in (lora_a, lora_b):
            continue
        dropout = _lora_input_relation(x_base, x_lora)
        if dropout is None:
            continue
        return LoraLinear(module=module_path(output), x=x_base, base=base, xa=xa, xab=xab, output=output,
                          weight=weight, lora_a=lora_a, lora_b=lora_b, rank=rank, scaling=scaling,
                          dropout=dropout)
    return None


def _follow_to_add(xab: Node) -> tuple[Node, Node, float] | None:
    """From the LoRA product, through views and constant scalings, to the add joining the base."""
    current, scaling = xab, 1.0
    for _ in range(4):
        users = users_through_views(current)
        if len(users) != 1:
            return None
        user = users[0]
        if user.target in (aten.mul.Tensor, aten.mul.Scalar):
            constants = [a for a in user.args if isinstance(a, numbers.Number)]
            if len(constants) != 1:
                return None
            scaling *= float(constants[0])
            current = user
        elif user.target is aten.add.Tensor and len(user.args) == 2 and "alpha" not in user.kwargs:
            side = next(a for a in user.args if isinstance(a, Node) and storage_base(a) is current)
            return user, side, scaling
        else:
            return None
    return None


def _lora_input_relation(x_base: Node, x_lora: Node) -> bool | None:
    """False if both branches read the same x, True if the LoRA branch reads dropout(x), else None."""
    base_storage = storage_base(x_base)
    if storage_base(x_lora) is base_storage:
        return False
    for producer in walk_back(x_lora, through=("native_dropout",)):
        if storage_base(producer) is base_storage:
            return True
    return None

