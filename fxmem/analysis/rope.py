"""Attention inputs: find the cheaper tensor a saved q, k or v can be rebuilt from.

Two rebuilds, composable: RoPE (q and k after rotation, from x before it and the
small cos/sin tables) and a repeat by expand + clone: grouped-query attention's k
and v repeated per query head (from the unrepeated tensor, ``n_rep`` times
smaller), eager attention's batched-matmul copies.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Node

from fxmem.analysis.graph import DTYPE_CASTS, aten, is_view, numel_hint, storage_base, tensor_val, view_chain
from fxmem.analysis.roles import rope_trig

# What x * cos + rotate_half(x) * sin is built from: cheap to replay in backward.
_ROTATION_OPS = frozenset({aten.mul.Tensor, aten.add.Tensor, aten.neg.default, aten.cat.default,
                           aten.clone.default}) | DTYPE_CASTS


@dataclass(frozen=True)
class Replay:
    """``nodes`` rebuild a saved tensor (the last node) from ``source``'s storage and the ``tables``."""

    source: Node  # a storage base: x before rotation, or the tensor before GQA's repeat
    nodes: tuple[Node, ...]  # forward nodes after source up to the saved tensor, in graph order
    tables: tuple[Node, ...]  # cos/sin operands (small), read as they are

    def describe(self) -> str:
        rotated = any(n.target is aten.add.Tensor for n in self.nodes)
        repeated = any(n.target is aten.expand.default for n in self.nodes)
        what = " and ".join(w for w, on in (("rotation", rotated), ("repeat (expand + clone)", repeated)) if on)
        return f"x before {'RoPE' if rotated else 'the repeat'} ({self.source.name}), {what} replayed in backward"


def attention_input_replay(saved: Node) -> Replay | None:
    """How the storage base ``saved`` of a q, k or v is rebuilt: GQA's repeat (a clone of an expanded view)
    undone, then RoPE undone; None if it is neither."""
    repeat: tuple[Node, ...] = ()
    node = saved
    chain = view_chain(node.args[0]) if node.target is aten.clone.default and isinstance(node.args[0], Node) else []
    # a view through a multi-output op (getitem of split) cannot be replayed alone: the copy is compressed as it is
    if any(v.target is aten.expand.default for v in chain) and all(v.target is not operator.getitem for v in chain):
        repeat = (*chain, node)
        node = storage_base(node.args[0])
        if node.op != "call_function":
            return None
    rope = rope_recompute(node)
    if rope is not None:
        return Replay(rope.source, rope.nodes + repeat, rope.tables)
    return Replay(node, repeat, ()) if repeat else None


def rope_recompute(rotated: Node) -> Replay | None:
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
    return Replay(source=source, nodes=tuple(sorted(inside, key=order.__getitem__)),
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
