"""What a graph holds at once: the transients of a step, beside what it saves between forward and backward.

At long context the step's peak is set as much by the tensors that live inside one graph (an MLP's intermediate and
its gradients, the loss's working set) as by the saved ones. This walks a partitioned graph in its order as its ops
would run it: each op's output storage is allocated when it runs and freed after its last reader (a view keeps its
base alive; the graph's outputs live to its end). It counts storages, not tensors, each at its full size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import is_view, storage_base, storage_bytes


@dataclass(frozen=True)
class Liveness:
    """A graph's transients, its inputs left out (a region's inputs are weights, the batch, or what forward saved,
    counted elsewhere)."""

    peak_bytes: int  # the most bytes its own ops' outputs hold at once
    end_bytes: int  # what they hold when it returns: its outputs

    @property
    def transient_bytes(self) -> int:
        """What the graph holds at its peak beyond what it returns."""
        return self.peak_bytes - self.end_bytes


def _allocated_bytes(node: Node) -> int:
    val = node.meta.get("val")
    values = val if isinstance(val, (tuple, list)) else [val]
    return sum(storage_bytes(v) for v in values if isinstance(v, torch.Tensor))


def graph_liveness(graph: Graph) -> Liveness:
    """The most bytes ``graph``'s ops hold at once when run in order, and what its outputs hold at the end."""
    nodes = list(graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    last_read: dict[Node, int] = {}  # per storage base: the position of its last reader (through views)
    outputs: set[Node] = set()
    for node in nodes:
        for arg in node.all_input_nodes:
            base = storage_base(arg)
            if node.op == "output":
                outputs.add(base)
            else:
                last_read[base] = max(last_read.get(base, -1), position[node])
    frees_after: dict[int, list[Node]] = {}
    for base, at in last_read.items():
        if base not in outputs:
            frees_after.setdefault(at, []).append(base)
    live: dict[Node, int] = {}
    current = peak = 0
    for i, node in enumerate(nodes):
        if node.op == "call_function" and not is_view(node) and storage_base(node) is node:
            live[node] = _allocated_bytes(node)
            current += live[node]
            peak = max(peak, current)
        for base in frees_after.get(i, ()):
            current -= live.pop(base, 0)
        if node in live and node not in last_read and node not in outputs:  # never read: freed at once
            current -= live.pop(node)
    return Liveness(peak_bytes=peak, end_bytes=current)
