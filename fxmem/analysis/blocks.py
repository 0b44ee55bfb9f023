"""The repeated blocks of a joint graph's forward (a transformer's layers), read from the module stack."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._inductor import inductor_prims
from torch.fx import Graph, Node

from fxmem.analysis.graph import layer_of, module_path
from fxmem.analysis.ops import dropout_probability, is_fused_attention


@dataclass(frozen=True)
class Block:
    name: str  # the block's module path, e.g. model.layers.3
    nodes: tuple[Node, ...]  # its forward nodes, in graph order
    outputs: tuple[Node, ...]  # its nodes that a forward node outside it reads
    random: str | None  # an op in it that draws random numbers other than from the step's seeds, if any

    @property
    def sources(self) -> tuple[Node, ...]:
        """What a checkpoint of the block saves: the forward activations it reads from outside it (the embedding, an
        earlier block's outputs), which backward recomputes it from, and its outputs."""
        inside = set(self.nodes)
        read = (a for n in self.nodes for a in n.all_input_nodes if a not in inside and a.op == "call_function"
                and is_forward(a) and isinstance(a.meta.get("val"), torch.Tensor))
        return tuple(dict.fromkeys((*read, *self.outputs)))


def is_forward(node: Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_forward"


def find_blocks(graph: Graph) -> list[Block]:
    """Every block of the joint graph's forward, in the order the forward runs them."""
    members: dict[str, list[Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and is_forward(node):
            name = layer_of(module_path(node))
            if name:
                members.setdefault(name, []).append(node)
    blocks = []
    for name, nodes in members.items():
        inside = set(nodes)
        outputs = tuple(n for n in nodes if any(is_forward(u) and u not in inside for u in n.users))
        random = next((str(n.target) for n in nodes if draws_random_numbers(n) and not draws_from_step_seed(n)), None)
        blocks.append(Block(name, tuple(nodes), outputs, random))
    return blocks


# inductor's joint-graph pass turns aten's random ops into these before fxmem's passes run (importing
# inductor_prims defines them)
_INDUCTOR_RANDOM = frozenset({inductor_prims.random, inductor_prims.randint})


def draws_from_step_seed(node: Node) -> bool:
    """Inductor's draw from the step's seeds (``inductor_random`` of ``inductor_lookup_seed(seeds, i)``): run again
    in backward, it draws the same numbers from the same seed."""
    seed = node.args[1] if node.target is inductor_prims.random and len(node.args) > 1 else None
    return isinstance(seed, Node) and seed.target is inductor_prims.lookup_seed


def draws_random_numbers(node: Node) -> bool:
    """A seeded op; fused attention only with dropout (its schema marks it seeded either way)."""
    if node.target in _INDUCTOR_RANDOM:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in node.target.tags:
        return False
    return not is_fused_attention(node) or dropout_probability(node) > 0
