"""Regenerate a LoRA input's dropout mask in backward from the seed it was drawn with, instead of saving it.

PEFT's ``lora_dropout`` (0.05 or 0.1 in most recipes) multiplies the LoRA branch's input by a keep-mask:
x' = x * mask / (1 - p). Autograd saves, per LoRA linear, the mask (a byte per element) and x' for A's gradient,
a copy of x that nothing else reads, so what the planner does for x (shared by q, k and v, rebuilt with attention,
stored once at 8 bits for the replayed X W) does not reach it.

Inductor draws every random tensor of a compiled graph from a per-step seed tensor (``inductor_random`` of
``inductor_lookup_seed(seeds, i)``): the same seed draws the same numbers. The draw, the mask and the scaling are
tagged must-recompute, so backward draws the mask again from the saved seeds (a few bytes) and rebuilds x' from x:
neither is saved, and the gradients are exactly those of torch.compile, which draws the same mask. A chain with any
other random op (one a replay would advance) is left as is, and named. Under
``torch._inductor.config.fallback_random`` dropout stays aten's native_dropout, which the LoRA matcher does not see
through: those LoRA linears are left as torch runs them. Run eagerly (``lowering="eager"``), a seeded draw is drawn
from its seed too (backend.run_eagerly).
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxmem.analysis.blocks import draws_from_step_seed, draws_random_numbers
from fxmem.analysis.graph import original_op, storage_base, tensor_val
from fxmem.analysis.lora import find_lora_linears, matmul_operands
from fxmem.fallback import unsupported
from fxmem.passes.joint.adapter_cast import keep_x_saved
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, joint_primals, pass_result, tag_must_recompute

prims = torch.ops.prims
SEEDED_DRAW = prims.inductor_random.default  # what inductor turns aten's random ops into
_SEED_LOOKUP = prims.inductor_lookup_seed.default


class ReplayDropout(GraphPass):
    name = "replay_dropout"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        replayed: dict[Node, tuple[list[Node], Node]] = {}  # x' -> its dropout's nodes and x, once per x'
        stateful = []
        for lora in find_lora_linears(graph, joint_primals(graph)):
            if not lora.dropout:
                continue
            x_lora = matmul_operands(lora.xa)[0]
            chain = dropout_nodes(x_lora, storage_base(lora.x))
            draws = [n for n in chain if draws_random_numbers(n)]
            if draws and all(map(draws_from_step_seed, draws)):
                replayed.setdefault(x_lora, (chain, lora.x))
            else:
                stateful.append(lora.module)
        for chain, x in replayed.values():
            tag_must_recompute(chain)
            keep_x_saved(x, state.config)
        parts = []
        if replayed:
            masks = sum(tensor_val(n).numel() for chain, _ in replayed.values() for n in chain
                        if tensor_val(n) is not None and tensor_val(n).dtype == torch.bool)
            parts.append(f"{len(replayed)} LoRA input dropout(s) replayed in backward from their seeds: "
                         f"{masks / 2**20:.2f} Mi mask elements and the dropped copies of x not saved")
        if stateful:
            parts.append(f"left as is, a dropout mask not drawn from a seed alone: {', '.join(stateful)}")
            unsupported(f"replay_dropout: {parts[-1]}", state.config)
        return pass_result(bool(replayed), *parts, redraws=bool(replayed))


def dropout_nodes(x_lora: Node, x: Node) -> list[Node]:
    """The nodes of native_dropout's decomposition between x's storage and the LoRA branch's input: the random
    draw and its seed lookup, the keep-mask, and the scaled product."""
    found, frontier, seen = [], [x_lora], set()
    while frontier:
        node = frontier.pop()
        if node in seen or node.op != "call_function" or storage_base(node) is x:
            continue
        seen.add(node)
        if original_op(node) == "native_dropout" or node.target in (SEEDED_DRAW, _SEED_LOOKUP):
            found.append(node)
            if node.target is not _SEED_LOOKUP:  # the seeds tensor is the step's, shared by every draw
                frontier.extend(a for a in node.args if isinstance(a, Node))
        elif node is x_lora or storage_base(node) is not node:  # views between x' and the product
            frontier.extend(a for a in node.args if isinstance(a, Node))
    return found

