"""Recompute in backward what forward builds from the graph's inputs alone, instead of saving it.

Two recipes save such tensors, each as large as what it is built from or larger:
- autocast over an fp32 model (``Trainer(bf16=True)``) casts every weight to bf16 before its matmul, and autograd
  saves each bf16 copy for the input's gradient, a weight's size per matmul, which can outweigh the activations
  (measured: docs/recipes.md);
- packed sequences (``position_ids`` restarting per document, as TRL's ``padding_free`` makes them) give attention
  a tokens x tokens float mask that transformers builds from the position ids, saved for SDPA's backward: 4 MiB at
  1,024 tokens, 64 MiB at 4,096, from a few KiB of ids.

Each is rebuilt by element-wise ops, views, casts and a few linear ops (analysis/recompute.py's input_derived)
from inputs the caller holds anyway (the weights, the batch). A cast of an input that backward reads, and an
attention mask built from the inputs, are tagged must-recompute with every node they are built from: backward
rebuilds them, at the cost of reading those inputs again, exactly. (Other such tensors, RoPE's tables, are left
to the planner, which prices them with the q and k they rebuild.)
"""

from __future__ import annotations

from torch.fx import Node

from fxmem.analysis.blocks import is_forward
from fxmem.analysis.graph import DTYPE_CASTS, storage_bytes, strip, tensor_val, users_through_views
from fxmem.analysis.meta import RECOMPUTE
from fxmem.analysis.ops import op_argument
from fxmem.analysis.recompute import input_derived
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState, joint_primals, tag_must_recompute


class RecomputeInputs(GraphPass):
    name = "recompute_inputs"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        primals = joint_primals(graph)
        derived = input_derived((n for n in graph.nodes if is_forward(n)), primals)
        casts = [n for n in derived if n.target in DTYPE_CASTS and strip(n.args[0], casts=False) in primals
                 and _read_by_backward(n)]
        masks = [n for n in derived if any(_reads_as_mask(user, n) for user in n.users) and _read_by_backward(n)]
        rebuilt = [n for n in casts + masks if RECOMPUTE not in n.meta]
        if not rebuilt:
            return UNCHANGED
        chains: set[Node] = set()
        stack = list(rebuilt)
        while stack:
            node = stack.pop()
            if node in derived and node not in chains:
                chains.add(node)
                stack.extend(node.all_input_nodes)
        tag_must_recompute(n for n in chains if RECOMPUTE not in n.meta)
        parts = [f"{len(group)} {what} ({sum(storage_bytes(tensor_val(n)) for n in group) / 2**20:.1f} MiB)"
                 for what, group in (("cast(s) of the inputs", [n for n in rebuilt if n in casts]),
                                     ("attention mask(s)", [n for n in rebuilt if n not in casts])) if group]
        return PassResult(True, f"{' and '.join(parts)} built from the graph's inputs alone, recomputed in backward")


def _read_by_backward(node: Node) -> bool:
    return any(not is_forward(user) for user in users_through_views(node))


def _reads_as_mask(user: Node, node: Node) -> bool:
    """``user`` (an attention op) reads ``node`` as its ``attn_mask``."""
    return op_argument(user, "attn_mask") is node
