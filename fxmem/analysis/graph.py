"""Small read-only queries on aten FX graphs, shared by every analysis."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Iterable, Iterator

import torch
from torch.fx import Node

aten = torch.ops.aten
prims = torch.ops.prims

# Ops that change only the dtype: a tensor seen through one is still "the same value".
DTYPE_CASTS = frozenset({prims.convert_element_type.default, aten._to_copy.default})
# Ops that fill a tensor with a constant: reading one adds no data dependency.
CONSTANT_FILLS = frozenset({aten.full.default, aten.scalar_tensor.default})


def is_replayable_pointwise(node: Node) -> bool:
    """An element-wise op (pointwise, or a dtype cast) that draws no random numbers: replayed, same values."""
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        torch.Tag.pointwise in target.tags or target in DTYPE_CASTS) and (
        torch.Tag.nondeterministic_seeded not in target.tags)


def is_view_op(target: object) -> bool:
    """True for aten ops whose output aliases their first input (view, permute, slice, split...)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def is_view(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        parent = node.args[0]
        return isinstance(parent, Node) and parent.op == "call_function" and is_view_op(parent.target)
    return is_view_op(node.target)


def view_source(node: Node) -> Node:
    """What a view node looks at: its first argument, or for getitem of split/unbind, the split's input."""
    return node.args[0].args[0] if node.target is operator.getitem else node.args[0]


def storage_base(node: Node) -> Node:
    """The node that allocated the storage ``node`` looks at (itself unless it is a view)."""
    while is_view(node):
        node = view_source(node)
    return node


def view_chain(node: Node) -> list[Node]:
    """The view nodes from ``node``'s storage base (exclusive) to ``node`` (inclusive), outermost first; a getitem
    of split or unbind comes with the op it takes an item of, so that a copy of the chain runs alone."""
    chain = []
    while is_view(node):
        chain.append(node)
        if node.target is operator.getitem:
            chain.append(node.args[0])
        node = view_source(node)
    return chain[::-1]


def users_through_views(node: Node) -> list[Node]:
    """Every non-view user of ``node`` or of a view of it (graph outputs excluded)."""
    found: list[Node] = []
    stack = [node]
    seen: set[Node] = set()
    while stack:
        current = stack.pop()
        for user in current.users:
            if user in seen or user.op == "output":
                continue
            seen.add(user)
            if is_view(user):
                stack.append(user)
            else:
                found.append(user)
    return found


def strip(node: object, *, casts: bool = True) -> object:
    """``node`` with views (and, by default, dtype casts) peeled off its front."""
    while isinstance(node, Node) and (is_view(node) or (casts and node.target in DTYPE_CASTS)):
        node = view_source(node) if is_view(node) else node.args[0]
    return node


def tensor_args(node: Node) -> list[Node]:
    return [a for a in node.args if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def original_op(node: Node) -> str:
    """The aten op this node was decomposed from (or its own target), as a short name.

    Inductor's decompositions split ops such as silu or native_layer_norm into
    primitives; each primitive keeps the original op in ``meta["original_aten"]``.
    """
    target = node.meta.get("original_aten") or node.target
    return op_name(target)


def op_name(target: object) -> str:
    """'silu' for aten.silu.default: the op without its overload."""
    if target is operator.getitem:
        return "getitem"
    return str(getattr(target, "_opname", None) or getattr(target, "__name__", target)).split(".")[0]


def schema_name(target: object) -> str | None:
    """'namespace::op' of an op overload (aten::mm, fxmem::nf4_linear), None for anything else."""
    schema = getattr(target, "_schema", None)
    return schema.name if schema is not None else None


def tensor_val(node: Node) -> torch.Tensor | None:
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def is_floating(val: torch.Tensor) -> bool:
    return val.dtype.is_floating_point or val.dtype.is_complex


def hint(value: int | torch.SymInt) -> int:
    """A concrete int for a (possibly symbolic) size, without adding guards."""
    if isinstance(value, torch.SymInt):
        h = value.node.hint
        if h is None:
            raise ValueError(f"size {value} has no hint (data-dependent)")
        return int(h)
    return int(value)


def shape_hint(val: torch.Tensor) -> tuple[int, ...]:
    return tuple(hint(s) for s in val.shape)


def shape_text(val: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in val.shape) + ")"


def numel_hint(val: torch.Tensor) -> int:
    return math.prod(shape_hint(val))


def storage_bytes(val: torch.Tensor) -> int:
    """Bytes of the storage a freshly allocated tensor with ``val``'s layout needs."""
    sizes = shape_hint(val)  # hints, never symbolic comparisons: those would add guards after dynamo is done
    if 0 in sizes:
        return 0
    strides = [hint(s) for s in val.stride()]
    span = 1 + sum((size - 1) * stride for size, stride in zip(sizes, strides) if size > 0)
    return (span + hint(val.storage_offset())) * val.element_size()


def memory_order(val: torch.Tensor) -> list[int] | None:
    """Dims from outermost to innermost in memory (``val.permute(order)`` is contiguous); None if not dense."""
    sizes, strides = shape_hint(val), [hint(s) for s in val.stride()]
    order = sorted(range(len(sizes)), key=lambda d: (-strides[d], d))
    expected = 1
    for d in reversed(order):
        if sizes[d] != 1 and strides[d] != expected:
            return None
        expected *= sizes[d]
    return order


def merged_channels(val: torch.Tensor, order: list[int], width: int | torch.SymInt) -> int:
    """How many of ``val``'s innermost memory dimensions (``order``: memory_order's) make up ``width``, the last
    dimension of a view of it: their sizes, all static, multiply to it (an attention output stored per head and
    read as (tokens, heads x head dim)). 1 where the innermost alone does, or no run of them does."""
    if not isinstance(width, int):
        return 1
    product = 1
    for count, d in enumerate(reversed(order), start=1):
        size = val.shape[d]
        if not isinstance(size, int):
            return 1
        product *= size
        if product >= width:
            return count if product == width else 1
    return 1


def is_reduced_shape(val: torch.Tensor) -> bool:
    """A per-row statistic or a scalar: 0-d/1-d, or a trailing dimension of size 1."""
    return val.dim() <= 1 or hint(val.shape[-1]) == 1


_MODULE_PART = re.compile(r"\['([^']*)'\]|\.([^.\[\]]+)")


def module_path(node: Node) -> str:
    """Dotted path of the innermost module that produced ``node`` ('' at the top level)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return clean_module_path(str(path))


def clean_module_path(raw: str) -> str:
    """Turn dynamo's source string (L['self'].__dict__['_modules']['model'].layers.0) into model.layers.0."""
    raw = raw.replace(".__dict__['_modules']", "").replace("._modules", "")
    raw = re.sub(r"^L\['[^']*'\]", "", raw)  # the compiled callable's own name: L['self'], L['fn']
    return ".".join(a or b for a, b in _MODULE_PART.findall(raw))


def layer_of(module: str) -> str:
    """The repeated block a module path belongs to ('model.layers.3' for '...layers.3.mlp'), or ''."""
    match = re.match(r"^(.*?\.\d+)(?:\.|$)", module)
    return match.group(1) if match else ""


def walk_back(node: Node, through: Iterable[object] = (), depth: int = 8) -> Iterator[Node]:
    """``node`` and its producers, following views, casts and the ops in ``through``."""
    through = set(through)
    frontier = [node]
    for _ in range(depth):
        next_frontier = []
        for current in frontier:
            yield current
            if current.op != "call_function":
                continue
            if is_view(current):
                next_frontier.append(view_source(current))
            elif current.target in DTYPE_CASTS or current.target in through or original_op(current) in through:
                next_frontier.extend(tensor_args(current))
        frontier = next_frontier
        if not frontier:
            return
