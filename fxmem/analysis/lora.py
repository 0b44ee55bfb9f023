"""Find LoRA linears in an aten graph by structure: y = x W^T + s * (x A^T) B^T.

The match uses only data flow and shapes (a rank-r matmul pair on the same input
as a frozen matmul, joined by an add), so it holds for PEFT's layers, a plain
module written by hand, and any architecture. A matmul may also be
fxmem::nf4_linear, whose weight is its packed NF4 operand: LoQT's layers
(fxmem.train.loqt) are this pattern with a frozen A (P) or B (P) and NF4 weights;
or bitsandbytes' gemm_4bit, the frozen product of QLoRA's Linear4bit.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from torch.fx import Graph, Node

from fxmem.analysis.graph import (
    aten,
    hint,
    is_view,
    module_path,
    schema_name,
    storage_base,
    strip,
    tensor_val,
    users_through_views,
    view_source,
    walk_back,
)

MATMULS = frozenset({aten.mm.default, aten.addmm.default})
# x @ deq(W)^T with W stored NF4 (operands: x, packed W), by name: analysis registers no op (fxmem.kernels does).
NF4_LINEAR = "fxmem::nf4_linear"
# bitsandbytes' Linear4bit (QLoRA's base layers): x @ deq(W)^T, operands (x, packed W, ...), by name likewise
BNB_GEMM_4BIT = "bitsandbytes::gemm_4bit"


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
    """One of a LoRA linear's three products: a matmul, fxmem::nf4_linear or bitsandbytes' 4-bit gemm."""
    return node.target in MATMULS or schema_name(node.target) in (NF4_LINEAR, BNB_GEMM_4BIT)


def matmul_operands(node: Node) -> tuple[Node, Node]:
    """The two matrices of mm/bmm, or of addmm/baddbmm (whose first argument is the added term)."""
    if node.target in (aten.addmm.default, aten.baddbmm.default):
        return node.args[1], node.args[2]
    return node.args[0], node.args[1]


def param_source(node: object, params: frozenset[Node]) -> Node | None:
    source = strip(node)
    return source if source in params else None


@dataclass(frozen=True)
class LoraSum:
    """``add`` = base + s * view((x A^T) B^T): where a LoRA linear's frozen and LoRA branches join."""

    add: Node
    base: Node  # the add's frozen-side operand, as the add reads it
    lora: Node  # the LoRA-side operand without its constant scalings: a view of ``product``, or ``product``
    product: Node  # (x A^T) B^T, a linear product
    scaling: float  # the constants the LoRA side is multiplied by (1.0 if none)


def lora_sums(add: Node) -> list[LoraSum]:
    """The ways ``add`` reads as a LoRA sum (either operand may be the LoRA side; callers check which holds): the
    one place fxmem recognises where a LoRA linear's branches join."""
    if add.op != "call_function" or add.target is not aten.add.Tensor or len(add.args) != 2 or add.kwargs or not all(
            isinstance(a, Node) for a in add.args):
        return []
    found = []
    for base, lora_side in (add.args, add.args[::-1]):  # PEFT's order first: base + lora
        scaled = _scaled_product(lora_side)
        if scaled is not None:
            found.append(LoraSum(add, base, *scaled))
    return found


def _scaled_product(node: Node) -> tuple[Node, Node, float] | None:
    """(what the innermost constant multiplication reads, or ``node`` without one; the linear product it views; the
    constants' product) when ``node`` is views and multiplications by constants of a product, each step read by
    this path alone."""
    scaling, unscaled = 1.0, node
    for _ in range(_MAX_SCALING_STEPS):
        if is_view(node):
            node = view_source(node)
            continue
        if node.target not in (aten.mul.Tensor, aten.mul.Scalar) or len(users_through_views(node)) != 1:
            break
        constants = [a for a in node.args if isinstance(a, numbers.Real)]
        tensors = [a for a in node.args if isinstance(a, Node)]
        if len(constants) != 1 or len(tensors) != 1:
            return None
        scaling *= float(constants[0])
        node = unscaled = tensors[0]
    if not is_linear_product(node) or len(users_through_views(node)) != 1:
        return None
    return unscaled, node, scaling


_MAX_SCALING_STEPS = 8  # views and scalings between a LoRA product and its add


def find_lora_linears(graph: Graph, params: frozenset[Node]) -> list[LoraLinear]:
    """Every LoRA linear of ``graph`` whose weights are among ``params``, in graph order."""
    found = []
    for node in graph.nodes:
        match = next(filter(None, (_match(joined, params) for joined in lora_sums(node))), None)
        if match is not None:
            found.append(match)
    return found


def _match(joined: LoraSum, params: frozenset[Node]) -> LoraLinear | None:
    lhs, b_t = matmul_operands(joined.product)
    lora_b, xa = param_source(b_t, params), storage_base(lhs)
    if lora_b is None or xa.op != "call_function" or not is_linear_product(xa):
        return None
    x_lora, a_t = matmul_operands(xa)
    lora_a = param_source(a_t, params)
    val = tensor_val(xa)
    if lora_a is None or val is None or val.dim() != 2:
        return None
    rank = hint(val.shape[-1])
    # The bottleneck is on the input side; a LoRA on a narrow head (2 classes, r=8) has r > out.
    if not rank < hint(tensor_val(x_lora).shape[-1]):
        return None
    base = strip(joined.base, casts=False)
    if not (isinstance(base, Node) and is_linear_product(base)):
        return None
    x_base, w_t = matmul_operands(base)
    weight = param_source(w_t, params)
    if weight is None or weight in (lora_a, lora_b):
        return None
    dropout = _lora_input_relation(x_base, x_lora)
    if dropout is None:
        return None
    return LoraLinear(module=module_path(joined.add), x=x_base, base=base, xa=xa, xab=joined.product,
                      output=joined.add, weight=weight, lora_a=lora_a, lora_b=lora_b, rank=rank,
                      scaling=joined.scaling, dropout=dropout)


def _lora_input_relation(x_base: Node, x_lora: Node) -> bool | None:
    """False if both branches read the same x (the LoRA branch perhaps a cast of it: PEFT's fp32 adapters on a
    half-precision model), True if the LoRA branch reads dropout(x), else None."""
    base_storage = storage_base(x_base)
    if any(storage_base(producer) is base_storage for producer in walk_back(x_lora)):
        return False
    for producer in walk_back(x_lora, through=("native_dropout",)):
        if storage_base(producer) is base_storage:
            return True
    return None

