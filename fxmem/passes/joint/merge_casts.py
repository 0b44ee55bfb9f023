"""One cast per value and dtype: duplicate dtype casts of one forward tensor merged before the joint passes match.

Autocast casts an op's inputs at every call: a LoRA linear run under ``torch.autocast`` casts x to bf16 once for
the frozen matmul and again for ``lora_A``, and the joint graph holds two equal cast nodes. The LoRA matcher
(analysis/lora.py) then sees two inputs, neither the other's storage, and leaves the linear alone: HyC-LoRA's
rebuilds from x did not apply to an fp32 model trained under autocast. Min-cut merges such duplicates itself (its
common-subexpression pass) after the joint passes ran; merging them first changes no value.
"""

from __future__ import annotations

from torch.fx import Node

from fxmem.analysis.blocks import is_forward
from fxmem.analysis.graph import DTYPE_CASTS
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState


class MergeCasts(GraphPass):
    name = "merge_casts"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        first: dict[tuple, Node] = {}
        merged = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in DTYPE_CASTS or not is_forward(node):
                continue
            key = (node.target, node.args, tuple(sorted(node.kwargs.items(), key=lambda kv: kv[0])))
            if key not in first:
                first[key] = node
                continue
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
            merged += 1
        return PassResult(True, f"{merged} duplicate cast(s) merged") if merged else UNCHANGED
