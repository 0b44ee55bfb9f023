"""What a graph holds at once: the transients of a step, beside what it saves between forward and backward.

At long context the step's peak is set as much by the tensors that live inside one graph (an MLP's intermediate and
its gradients, the loss's working set) as by the saved ones. This walks a partitioned graph in its order as its ops
would run it: each op's output storage is allocated when it runs and freed after its last reader (a view keeps its
base alive; the graph's outputs live to its end). It counts storages, not tensors, each at its full size.

A backward's inputs are what forward saved. Run as aten ops (the eager lowering) it holds them all to its end;
inductor's backward frees each after its last reader, so its peak beyond the saved bytes is lower: both are
counted. What inductor fuses and where it puts each kernel is not modelled (docs/long-context.md has the error).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import is_view, storage_base, storage_bytes
from fxmem.analysis.saved import saved_placeholders


@dataclass(frozen=True)
class Liveness:
    """A graph's transients, its inputs left out (a region's inputs are weights, the batch, or what forward saved,
    counted elsewhere)."""

    peak_bytes: int  # the most bytes its own ops' outputs hold at once
    end_bytes: int  # what they hold when it returns: its outputs
    # with its released inputs freed after their last reader (an inductor backward frees the saved activations so):
    # the most its own outputs and the released inputs not yet freed hold at once, less all the released inputs
    peak_beyond_released: int = 0

    @property
    def transient_bytes(self) -> int:
        """What the graph holds at its peak beyond what it returns."""
        return self.peak_bytes - self.end_bytes


# Ops that return a new tensor but that every lowering runs as a view of their (contiguous) input.
ALIASING_OPS = frozenset({torch.ops.aten._unsafe_view.default})
Storage = Node | tuple[Node, int]  # an op's output, or one output of an op that returns several


def _base(node: Node) -> Node:
    while is_view(node) or node.target in ALIASING_OPS:
        node = node.args[0] if node.target in ALIASING_OPS else storage_base(node)
    return node


def _storage(node: Node) -> Storage:
    """What ``node`` reads when it reads a tensor: an op's storage, or one item of an op with several outputs."""
    base = _base(node)
    if base.target is operator.getitem and isinstance(base.args[0], Node) \
            and isinstance(base.args[0].meta.get("val"), (tuple, list)):
        return base.args[0], base.args[1]
    return base


def _allocations(node: Node) -> dict[Storage, int]:
    """The storages ``node``'s op allocates, with their bytes (none for views, items of a tuple and non-tensors)."""
    if node.op != "call_function" or _base(node) is not node or node.target is operator.getitem:
        return {}
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return {(node, i): storage_bytes(v) for i, v in enumerate(val) if isinstance(v, torch.Tensor)}
    return {node: storage_bytes(val)} if isinstance(val, torch.Tensor) else {}


def released_activations(fw: Graph, bw: Graph, num_fwd_outputs: int) -> dict[Node, tuple[Node, int]]:
    """Backward's inputs that hold a forward activation, each with the forward storage it holds and that storage's
    bytes. AOTAutograd hands them to the compiled backward, which frees each after its last reader; the ones that
    are forward inputs (parameters, the batch) live on elsewhere."""
    released = {}
    for node, placeholder in saved_placeholders(fw, bw, num_fwd_outputs).items():
        base = _base(node)
        if base.op == "call_function":
            released[placeholder] = base, storage_bytes(base.meta["val"])
    return released


def graph_liveness(graph: Graph, workspace: Callable[[Node], int] = lambda node: 0, *,
                   released: dict[Node, tuple[Node, int]] | None = None) -> Liveness:
    """The most bytes ``graph``'s ops hold at once when run in order, and what its outputs hold at the end.
    ``workspace(node)``: what the op holds inside while it runs, beyond its inputs and outputs (an opaque op that
    works in chunks). ``released``: inputs freed after their last reader (``released_activations``), for
    ``peak_beyond_released``."""
    released = released or {}
    nodes = list(graph.nodes)

    def reads(arg: Node) -> Storage:
        storage = _storage(arg)
        return released[storage][0] if storage in released else storage

    last_read: dict[Storage, int] = {}  # the position of each storage's last reader (through views)
    outputs: set[Storage] = set()
    for position, node in enumerate(nodes):
        if node.target is operator.getitem or _base(node) is not node:
            continue  # taking an item or a view reads nothing; its readers read the storage
        for arg in node.all_input_nodes:
            if node.op == "output":
                outputs.add(reads(arg))
            else:
                last_read[reads(arg)] = position
    live: dict[Storage, int] = {}
    frees_after: dict[int, list[Storage]] = {}
    for storage, position in last_read.items():
        if storage not in outputs:
            frees_after.setdefault(position, []).append(storage)
    inputs = dict(released.values())
    released_bytes = sum(inputs.values())
    held_inputs = sum(size for storage, size in inputs.items() if storage in last_read or storage in outputs)
    current = peak = peak_releasing = 0
    for position, node in enumerate(nodes):
        allocated = _allocations(node)
        live.update(allocated)
        current += sum(allocated.values())
        peak = max(peak, current + workspace(node))
        peak_releasing = max(peak_releasing, current + held_inputs + workspace(node))
        unread = [s for s in allocated if s not in last_read and s not in outputs]  # freed as soon as made
        for storage in [*frees_after.get(position, ()), *unread]:
            current -= live.pop(storage, 0)
            held_inputs -= inputs.pop(storage, 0)
    return Liveness(peak_bytes=peak, end_bytes=current, peak_beyond_released=peak_releasing - released_bytes)
