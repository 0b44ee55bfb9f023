"""Saved tensors backward can recompute for free: element by element (or row by row) from what it holds anyway.

A norm's output is its input (saved for the norm's own backward) times the per-row statistic (saved too) times
the weight; torch's min-cut still saves it when the next linear's backward reads it. Backward can rebuild such a
tensor from the saved tensors and parameters it already has, with a few element-wise ops fused into whatever reads
it: no saved byte more, no matmul. This module finds those chains; the planner prices them against compression.

It also finds the one matmul that rebuilds a LoRA linear's frozen product x W^T from the saved x and the frozen
weight: not free, but exact up to x's own storage (cost_model.options.replayed_plan prices it). A mixture of experts'
chains may replay the experts' grouped products too (their routed rows gathered from x, each expert's frozen weight
and its LoRA): the planner prices those by their flops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.fx import Node

from fxmem.analysis.graph import DTYPE_CASTS, is_replayable_pointwise, is_view, schema_name, tensor_val
from fxmem.analysis.lora import is_linear_product
from fxmem.analysis.ops import GROUPED_MATMULS

# Ops a recomputation may replay: past this the chain is not the cheap kind.
MAX_CHAIN = 16


def pointwise_rebuild(base: Node, saved_bases: frozenset[Node]) -> tuple[Node, ...] | None:
    """The forward nodes that rebuild the storage ``base`` element by element from other saved storages and graph
    inputs (in graph order, ``base`` last), or None when it needs anything else (a matmul, a reduction, random
    numbers, a forward value that is not saved) or is itself a graph input. The experts' grouped products count as
    element-wise here (each row times its expert's weight): ``replays_product`` tells such a chain apart."""
    if base.op != "call_function":
        return None
    return _chain(base, saved_bases, lambda node: is_replayable_pointwise(node) or is_view(node) or is_row_gather(node)
                  or is_grouped_product(node))


def is_grouped_product(node: Node) -> bool:
    """A grouped matmul of rows sorted by expert with stacked expert weights, or fxmem's LoRA on them."""
    return node.op == "call_function" and schema_name(node.target) in GROUPED_MATMULS


def replays_product(chain: tuple[Node, ...]) -> bool:
    """The chain runs a grouped product again: a matmul's flops, not a free recomputation."""
    return any(map(is_grouped_product, chain))


def is_row_gather(node: Node) -> bool:
    """``x[indices]``: rows picked by one integer index (the tokens a mixture of experts routes to each expert,
    each row once per chosen expert); as cheap to replay as a copy of what it writes."""
    if node.target is not aten.index.Tensor or len(node.args) != 2 or len(node.args[1]) != 1:
        return False
    index = node.args[1][0]  # integers: a boolean mask would replay a data-dependent nonzero
    return isinstance(index, Node) and tensor_val(index).dtype in (torch.int32, torch.int64)


def product_rebuild(base: Node, saved_bases: frozenset[Node]) -> tuple[Node, ...] | None:
    """The linear product ``base`` and the views and casts it reads, when they rebuild it from saved storages and
    graph inputs (a LoRA linear's x W^T from the saved x and the frozen weight: autocast's bf16 copy of it, or an
    NF4 weight's codes and quantization state), in graph order; None otherwise."""
    if base.op != "call_function" or not is_linear_product(base):
        return None
    return _chain(base, saved_bases, lambda node: node is base or is_view(node) or node.target in DTYPE_CASTS)


def _chain(base: Node, saved_bases: frozenset[Node], replayable: Callable[[Node], bool]) -> tuple[Node, ...] | None:
    """The nodes from ``base`` back to saved storages and graph inputs, each ``replayable``; None if one is not."""
    chain: set[Node] = set()
    stack = [base]
    while stack:
        node = stack.pop()
        if node in chain or (node is not base and (node in saved_bases or node.op == "placeholder")):
            continue
        if node.op != "call_function" or not replayable(node):
            return None
        if len(chain) == MAX_CHAIN:
            return None
        chain.add(node)
        stack.extend(a for a in node.all_input_nodes if tensor_val(a) is not None)
    order = {n: i for i, n in enumerate(base.graph.nodes)}
    return tuple(sorted(chain, key=order.__getitem__))


def rebuild_inputs(chain: tuple[Node, ...]) -> list[Node]:
    """What a chain reads from outside itself: saved storages and graph inputs."""
    inside = set(chain)
    return list(dict.fromkeys(a for n in chain for a in n.all_input_nodes
                              if a not in inside and tensor_val(a) is not None))


aten = torch.ops.aten
# Ops beyond the element-wise ones that rebuild a tensor from the graph's inputs deterministically and cheaply
# (linear in what they read or write): what transformers' packed-sequence mask is made of (position ids through a
# shifted difference, a cumulative sum, and an index by iotas into a tokens x tokens comparison).
_INPUT_REBUILD_OPS = frozenset({
    torch.ops.prims.iota.default, aten.arange.default, aten.arange.start, aten.arange.start_step,
    aten.scalar_tensor.default, aten.full.default, aten.new_ones.default, aten.new_zeros.default,
    aten.new_full.default, aten.cat.default, aten.cumsum.default, aten.index.Tensor})


def input_derived(nodes: Iterable[Node], primals: frozenset[Node]) -> dict[Node, frozenset[Node]]:
    """The forward nodes (of ``nodes``, in graph order) computed from the graph's inputs alone by element-wise ops,
    views, dtype casts and _INPUT_REBUILD_OPS, none of them random: each with the inputs it reads."""
    derived: dict[Node, frozenset[Node]] = {}
    for node in nodes:
        if node.op != "call_function" or not (is_replayable_pointwise(node) or is_view(node)
                                              or node.target in _INPUT_REBUILD_OPS):
            continue
        inputs = [a for a in node.all_input_nodes if tensor_val(a) is not None]
        if all(a in primals or a in derived for a in inputs):
            derived[node] = frozenset().union(*({a} if a in primals else derived[a] for a in inputs))
    return derived


def copies_values(chain: tuple[Node, ...]) -> bool:
    """The chain only moves values (row gathers and views): rebuilt from a compressed storage, it carries that
    storage's error and adds none."""
    return all(is_row_gather(n) or is_view(n) for n in chain)
