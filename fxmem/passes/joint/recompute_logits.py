"""Recompute the loss's logits in backward from the LM head's input instead of saving them.

The log-softmax of a cross-entropy loss needs the logits in backward: a
(tokens x vocabulary) tensor, the largest one a LoRA step saves (vocabulary /
hidden times the head's input). Tagging the head's matmul, and the views and
casts from it to the log-softmax, as must-recompute makes torch's min-cut save
the head's input (or what it is recomputed from) instead, at the price of one
more head matmul in backward. What the logits are then recomputed from (the
final norm's input, on Llama) the analysis marks loss_input too, and the planner
keeps it exact: quantized, its error reached every gradient through the loss,
and exact it is a small share of the saved bytes (measured: docs/quantization.md).
"""

from __future__ import annotations

from torch.fx import Node

from fxmem.analysis.graph import (
    DTYPE_CASTS,
    is_replayable_pointwise,
    is_view,
    numel_hint,
    original_op,
    storage_bytes,
    tensor_args,
    tensor_val,
)
from fxmem.analysis.lora import MATMULS, matmul_operands
from fxmem.analysis.ops import LOG_SOFTMAXES
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState, tag_must_recompute


class RecomputeLogits(GraphPass):
    name = "recompute_logits"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        heads: dict[Node, set[Node]] = {}
        for node in state.joint.graph.nodes:
            if node.op != "call_function" or original_op(node) not in LOG_SOFTMAXES:
                continue
            for arg in node.all_input_nodes:
                chain = _chain_to_matmul(arg)
                if chain is not None:
                    heads.setdefault(chain[0], set()).update(chain)
        for chain in heads.values():
            tag_must_recompute(chain)
        if not heads:
            return UNCHANGED
        freed = sum(storage_bytes(tensor_val(head)) for head in heads)
        note = f"{len(heads)} logits tensor(s) ({freed / 2**20:.1f} MiB) tagged to be recomputed from the LM head input"
        return PassResult(True, note)


def _chain_to_matmul(node: Node) -> list[Node] | None:
    """[matmul, views/casts/element-wise ops of it alone...] ending at ``node`` if ``node`` is a matmul's output seen
    through those (soft-capped logits: tanh(logits / cap) * cap)."""
    chain = []
    while node.op == "call_function" and (is_view(node) or node.target in DTYPE_CASTS or (
            is_replayable_pointwise(node) and len(tensor_args(node)) == 1)):
        chain.append(node)
        node = tensor_args(node)[0] if not is_view(node) else node.all_input_nodes[0]
    if node.op != "call_function" or node.target not in MATMULS:
        return None
    lhs, _ = matmul_operands(node)
    if numel_hint(tensor_val(node)) <= numel_hint(tensor_val(lhs)):
        return None  # recomputing saves nothing: the input is as large as the logits
    return [node, *chain[::-1]]
