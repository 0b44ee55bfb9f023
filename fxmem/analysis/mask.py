"""Attention masks proven causal, in the graph dynamo captured (torch-level ops, before AOTAutograd).

Under torch.compile, HF transformers builds the whole (batch, 1, tokens, tokens) boolean mask and passes it to
SDPA, which saves it for backward: its check that would pass ``is_causal=True`` instead reads values, so it is
skipped while tracing. At long context that mask outgrows everything else (a byte a token pair as bool, 2 in bf16
where a kernel converts it: quadratic in the length). Its values depend on no input of the graph, only on
aranges of the sequence length, so they can be read here without building it:

- every tensor of its construction narrower than the mask (a vector of positions, a (batch, tokens) row of
  packed-sequence ids) is evaluated on the CPU, for real;
- the tokens x tokens tensors are kept symbolic, as a conjunction of comparisons ``row op column`` between two
  such vectors.

The mask is causal when one comparison is ``kv <= q`` over one strictly increasing sequence of positions and
every other one holds everywhere (checked from the vectors' extremes: a sufficient condition). Anything else (a
padding mask read from the batch, a sliding window, an additive float mask, a symbolic length) is left as it is,
with the reason.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.node import map_arg
from torch.utils._pytree import tree_map

SDPA = torch._C._nn.scaled_dot_product_attention
# F.scaled_dot_product_attention's parameters, in order (a builtin: its signature is not introspectable)
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

# ``a op b`` as the name of op, for functions and Tensor methods alike
_COMPARISONS: dict[Any, str] = {operator.le: "le", operator.lt: "lt", operator.ge: "ge", operator.gt: "gt",
                                operator.eq: "eq", torch.le: "le", torch.lt: "lt", torch.ge: "ge", torch.gt: "gt",
                                torch.eq: "eq", "le": "le", "lt": "lt", "ge": "ge", "gt": "gt", "eq": "eq"}
_SWAPPED = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq"}
_CONJUNCTIONS = frozenset({operator.and_, operator.iand, torch.logical_and, torch.bitwise_and, "logical_and",
                           "bitwise_and", "__and__"})
# Methods that leave a boolean mask's values as they are (a broadcast, a copy, a move between devices)
_SAME_VALUES = frozenset({"to", "expand", "contiguous", "bool"})


@dataclass(frozen=True)
class CausalMask:
    mask: Node
    attention: tuple[Node, ...]  # the SDPA calls it feeds
    shape: tuple[int, ...]


@dataclass(frozen=True)
class UnprovenMask:
    mask: Node
    attention: tuple[Node, ...]
    reason: str


@dataclass(frozen=True)
class _Comparison:
    """``left op right`` over the mask's last two axes, each side a tensor of size 1 along one of them."""

    op: str
    left: torch.Tensor
    right: torch.Tensor


class _Unproven(Exception):
    pass


def sdpa_arguments(node: Node) -> dict[str, Any]:
    """An SDPA call's arguments by name, positional or keyword."""
    return dict(zip(SDPA_PARAMETERS, node.args, strict=False)) | dict(node.kwargs)


def find_attention_masks(gm: GraphModule) -> list[CausalMask | UnprovenMask]:
    """Every mask passed to SDPA in ``gm`` (with ``is_causal=False``), proven causal or with the reason it is not."""
    users: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is SDPA:
            arguments = sdpa_arguments(node)
            if isinstance(arguments.get("attn_mask"), Node) and arguments.get("is_causal", False) is False:
                users.setdefault(arguments["attn_mask"], []).append(node)
    found = []
    for mask, attention in users.items():
        try:
            found.append(CausalMask(mask, tuple(attention), _prove_causal(gm, mask)))
        except _Unproven as reason:
            found.append(UnprovenMask(mask, tuple(attention), str(reason)))
    return found


def _prove_causal(gm: GraphModule, mask: Node) -> tuple[int, ...]:
    value = mask.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool:
        raise _Unproven("not a boolean mask (an additive float mask is not read)")
    shape = value.shape
    if value.dim() < 2 or not all(isinstance(s, int) for s in shape):
        raise _Unproven(f"a mask of symbolic shape {tuple(shape)}")
    if shape[-1] != shape[-2] or shape[-1] < 2:
        raise _Unproven(f"not square over its last two axes: {tuple(shape)}")
    values: dict[Node, Any] = {}
    for node in _ancestors(mask, gm.graph):
        values[node] = _value(gm, node, values, shape)
    _check_causal(values[mask])
    return tuple(shape)


def _ancestors(node: Node, graph: Graph) -> list[Node]:
    """``node`` and every node it reads, in graph order."""
    seen, stack = {node}, [node]
    while stack:
        for source in stack.pop().all_input_nodes:
            if source not in seen:
                seen.add(source)
                stack.append(source)
    return [n for n in graph.nodes if n in seen]


def _is_wide(node: Node, shape: torch.Size) -> bool:
    """A tensor as wide as the mask over its last two axes: never built here."""
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() == len(shape) and value.shape[-2:] == shape[-2:]


def _value(gm: GraphModule, node: Node, values: dict[Node, Any], shape: torch.Size) -> Any:
    if node.op == "placeholder":
        raise _Unproven(f"it reads the input {node.target!r} (a padding mask from the batch, or positions passed in)")
    if node.op == "get_attr":
        return _on_cpu(_attribute(gm, node.target))
    if node.op not in ("call_function", "call_method"):
        raise _Unproven(f"it reads {node.op} {node.target}")
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: values[n])
    if _is_wide(node, shape):
        return _symbolic(node, args, kwargs)
    if any(isinstance(a, list) for a in (*args, *kwargs.values())):  # a conjunction would be read by a narrow op
        raise _Unproven(f"{node.format_node()} reads the tokens x tokens mask")
    args, kwargs = tree_map(_on_cpu, (tuple(args), dict(kwargs)))
    if "device" in kwargs:  # also a device given by name
        kwargs["device"] = "cpu"
    try:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    except Exception as error:
        raise _Unproven(f"{node.format_node()} could not be evaluated ({type(error).__name__}: {error})") from error


def _attribute(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for name in target.split("."):
        value = getattr(value, name)
    return value


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.device):
        return torch.device("cpu")
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    return value


def _symbolic(node: Node, args: tuple, kwargs: dict) -> list[_Comparison | torch.Tensor]:
    """A tokens x tokens boolean tensor as the conjunction (a list) of its terms: comparisons and narrow tensors."""
    target = node.target
    if target in _COMPARISONS and len(args) == 2 and not kwargs:
        left, right = (a if isinstance(a, torch.Tensor) else torch.tensor(a) for a in args)
        if not isinstance(args[0], list) and not isinstance(args[1], list):
            return [_Comparison(_COMPARISONS[target], left, right)]
    if target in _CONJUNCTIONS and len(args) == 2 and not kwargs:
        return [term for a in args for term in (a if isinstance(a, list) else [_as_bool(a, node)])]
    if node.op == "call_method" and target in _SAME_VALUES and isinstance(args[0], list) \
            and node.meta["example_value"].dtype == torch.bool:
        return args[0]
    raise _Unproven(f"{node.format_node()} is not a comparison of positions or a conjunction of them")


def _as_bool(value: Any, node: Node) -> torch.Tensor:
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return value
    raise _Unproven(f"{node.format_node()} is not a conjunction of boolean tensors")


def _check_causal(terms: Any) -> None:
    if not isinstance(terms, list):
        raise _Unproven("it is not built from comparisons of positions")
    causal = 0
    for term in terms:
        if isinstance(term, torch.Tensor):
            if not bool(term.all()):
                raise _Unproven("one of its terms is false somewhere")
        elif _is_causal(term):
            causal += 1
        elif not _holds_everywhere(term):
            raise _Unproven(f"a {term.op} comparison neither causal nor true everywhere (e.g. a sliding window "
                            "or packed sequences)")
    if not causal:
        raise _Unproven("no term orders keys before queries")


def _is_causal(term: _Comparison) -> bool:
    """``kv <= q`` with keys varying along the last axis, queries along the one before, over the same strictly
    increasing positions in every batch row: true exactly on and below the diagonal."""
    op, left, right = term.op, term.left, term.right
    if op in ("ge", "gt"):
        op, left, right = _SWAPPED[op], right, left
    if op != "le" or left.dim() < 2 or right.dim() < 2 or left.shape[-2] != 1 or right.shape[-1] != 1:
        return False
    lead = torch.broadcast_shapes(left.shape[:-2], right.shape[:-2])
    keys = left.expand(*lead, *left.shape[-2:])[..., 0, :].reshape(-1, left.shape[-1])
    queries = right.expand(*lead, *right.shape[-2:])[..., :, 0].reshape(-1, right.shape[-2])
    return keys.shape == queries.shape and torch.equal(keys, queries) and bool((keys.diff(dim=-1) > 0).all())


_EVERYWHERE: dict[str, tuple[Callable, Callable, Callable]] = {  # op: (reduce left, reduce right, compare)
    "le": (torch.amax, torch.amin, torch.le), "lt": (torch.amax, torch.amin, torch.lt),
    "ge": (torch.amin, torch.amax, torch.ge), "gt": (torch.amin, torch.amax, torch.gt)}


def _holds_everywhere(term: _Comparison) -> bool:
    """Sufficient: per leading index, the extremes of both sides over the last two axes satisfy the comparison
    (for ``eq``: both sides one and the same constant)."""
    left, right = (t.reshape(1, 1) if t.dim() < 2 else t for t in (term.left, term.right))
    if term.op == "eq":
        lows = (torch.amin(left, (-2, -1)), torch.amin(right, (-2, -1)))
        highs = (torch.amax(left, (-2, -1)), torch.amax(right, (-2, -1)))
        return all(bool(torch.eq(a, b).all()) for a in (*lows, *highs) for b in (*lows, *highs))
    reduce_left, reduce_right, compare = _EVERYWHERE[term.op]
    return bool(compare(reduce_left(left, (-2, -1)), reduce_right(right, (-2, -1))).all())
