"""PEFT LoRA linears in the graph dynamo captured (torch-level ops), grouped by the input they read: an
attention's q, k and v projections are one group, its o projection another.

A linear is ``x W^T + scale (x A^T) B^T`` on a frozen W, cast back to x's dtype, as PEFT runs it
(analysis/mlp.py's matcher). Its output must be in x's dtype: the chunked op (kernels/chunked_lora_linear.py)
returns that. W's dtype is x's, or the base computes between two casts written in the graph (a bitsandbytes 4-bit
base, passes/dynamo/dequantize_bases.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from fxmem.analysis.graph import hint
from fxmem.analysis.loss import base_computes_cast, cast_dtype, example_tensor
from fxmem.analysis.mlp import LoraLinearNodes, adapter_keeps_its_dtype, lora_linear_of


@dataclass(frozen=True)
class LoraLinearGroup:
    x: Node
    linears: tuple[LoraLinearNodes, ...]
    outputs: tuple[Node, ...]  # each linear's output, cast back to x's dtype
    tokens: int  # x's rows (a dynamic count: its hint)
    after: Node  # where its op goes: after its last operand, and after every placeholder (the graph's inputs)


def find_lora_linear_groups(graph: Graph) -> tuple[list[LoraLinearGroup], int]:
    """Every group of PEFT LoRA linears on a frozen base weight that read one input, in graph order, each of them
    placed where all the group's operands exist before any of its outputs is read (a group that is not is split into
    its linears); and how many LoRA linears were left out because their output's or base weight's dtype is not their
    input's (as under autocast, which the op does not reproduce)."""
    by_input: dict[Node, list[tuple[Node, LoraLinearNodes]]] = {}
    other_dtype = 0
    for node in graph.nodes:
        found = lora_linear_of(node) if node.op == "call_function" else None
        if found is None:
            continue
        x, linear = found
        output = _cast_back(node)
        x_value, out_value = example_tensor(x), example_tensor(output)
        if x_value is None or out_value is None:
            continue
        weight_value = example_tensor(linear.weight)
        between_casts = any(isinstance(arg, Node) and base_computes_cast(arg) for arg in node.args)
        if out_value.dtype != x_value.dtype or weight_value is None or not adapter_keeps_its_dtype(linear) \
                or (weight_value.dtype != x_value.dtype and not between_casts):
            other_dtype += 1  # the op computes x W^T as it is, or between the casts written out
            continue
        by_input.setdefault(x, []).append((output, linear))
    order = {node: position for position, node in enumerate(graph.nodes)}
    inputs = list(graph.find_nodes(op="placeholder"))
    groups = []
    for x, members in by_input.items():
        for part in ([members] if _placeable(members, x, order) else [[m] for m in members]):
            value = example_tensor(x)
            linears = tuple(linear for _, linear in part)
            after = max(_operands(linears, x), key=order.__getitem__)
            groups.append(LoraLinearGroup(
                x=x, linears=linears, outputs=tuple(output for output, _ in part),
                tokens=hint(value.numel() // value.shape[-1]),
                after=inputs[-1] if after.op == "placeholder" else after))
    return groups, other_dtype


def _cast_back(total: Node) -> Node:
    """PEFT's ``.to(result dtype)`` after the sum where it is the sum's only reader, else the sum."""
    cast = next(iter(total.users)) if len(total.users) == 1 else None
    return cast if cast is not None and cast_dtype(cast) is not None else total


def _operands(linears: tuple[LoraLinearNodes, ...] | list[LoraLinearNodes], x: Node) -> list[Node]:
    return [x, *(n for linear in linears for n in (linear.weight, linear.a, linear.b))]


def _placeable(members: list[tuple[Node, LoraLinearNodes]], x: Node, order: dict[Node, int]) -> bool:
    """The group's adapters share a dtype (the op's backward casts x to it once a chunk), and every operand of the
    group is made before any output of it is read (not so where a member's weight is dequantized after another
    member's output is reshaped)."""
    if len({getattr(example_tensor(linear.a), "dtype", None) for _, linear in members}) > 1:
        return False
    last_operand_position = max(order[n] for n in _operands([linear for _, linear in members], x))
    first_read = min((order[user] for output, _ in members for user in output.users), default=len(order))
    return last_operand_position < first_read
