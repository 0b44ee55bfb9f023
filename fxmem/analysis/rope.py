"""Rotary embeddings: find the pre-rotation tensor a saved q or k can be rebuilt from."""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from fxmem.analysis.graph import DTYPE_CASTS, aten, is_view, numel_hint, storage_base, tensor_val
from fxmem.analysis.roles import rope_trig

# What x * cos + rotate_half(x) * sin is built from: cheap to replay in backward.
_ROTATION_OPS = frozenset({aten.mul.Tensor, aten.add.Tensor, aten.neg.default, aten.cat.default,
                           aten.clone.default}) | DTYPE_CASTS


@dataclass(frozen=True)
class RopeRecompute:
    """``nodes`` rebuild the rotated tensor (the last node) from ``source``'s storage and the ``tables``."""

    source: Node  # storage base of x, the tensor before rotation
    nodes: tuple[Node, ...]  # forward nodes after source up to the rotated tensor, in graph order
    tables: tuple[Node, ...]  # cos/sin operands (small), read as they are


def rope_recompute(rotated: Node) -> RopeRecompute | None:
    """How ``rotated`` = x * cos + rotate_half(x) * sin is rebuilt from x; None if it is not that."""
    if rotated.target is not aten.add.Tensor:
        return None
    source = _rotation_input(rotated)
    if source is None:
        return None
    inside: set[Node] = set()
    tables: set[Node] = set()
    stack = [rotated]
    while stack:
        node = stack.pop()
        if node in inside or node is source:
            continue
        if _is_table(node, rotated):
            tables.add(node)
            continue
        if node.op != "call_function" or not (is_view(node) or node.target in _ROTATION_OPS):
            return None  # something other than a rotation of x: leave it to the plain plan
        inside.add(node)
        stack += _tensor_inputs(node)
    if not tables or numel_hint(tensor_val(source)) != numel_hint(tensor_val(rotated)):
        return None  # a fused q/k/v projection feeds several rotations: leave it to the plain plan
    order = {n: i for i, n in enumerate(rotated.graph.nodes)}
    return RopeRecompute(source=source, nodes=tuple(sorted(inside, key=order.__getitem__)),
                         tables=tuple(sorted(tables, key=order.__getitem__)))


def _rotation_input(rotated: Node) -> Node | None:
    """The storage base of x in the x * cos term of ``rotated``."""
    for term in rotated.args[:2]:
        if not isinstance(term, Node) or term.target is not aten.mul.Tensor:
            return None
        operands = _tensor_inputs(term)
        if len(operands) == 2 and any(_is_table(o, rotated) for o in operands):
            x = next(o for o in operands if not _is_table(o, rotated))
            if x.target is not aten.cat.default and is_view(x):
                base = storage_base(x)
                return base if base.op == "call_function" else None
    return None


def _is_table(node: Node, rotated: Node) -> bool:
    """A cos/sin table: smaller than the rotated tensor (it broadcasts over batch and heads)."""
    return numel_hint(tensor_val(node)) < numel_hint(tensor_val(rotated)) and \
        rope_trig(storage_base(node)) is not None


def _tensor_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes if tensor_val(a) is not None]
