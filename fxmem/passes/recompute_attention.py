"""Recompute fused attention's output in backward from its compressed q, k, v instead of saving it.

Fused attention's backward reads its forward output O in D = rowsum(dO * O),
which must equal sum_j P_ij dP_ij for the softmax gradient's rows to sum to
zero. Once q, k or v are stored quantized or as low-rank factors, the P and dP backward recomputes no
longer match the saved, exact O; the mismatch lands on the key and query
gradients, which are small differences (measured on llama-tiny at 4 bits: key
LoRA gradient cosine 0.65 with O saved exact). Tagging the attention op as
must-recompute makes min-cut save q, k, v (which the quantize or lowrank pass
then compresses) and rerun the forward in backward on the very values backward
uses: consistent, and O and its log-sum-exp are no longer saved at all. The
price is one more attention forward per layer in backward, priced in the summary at the device's measured
matmul rate. Attention with dropout is left alone: its random mask would not be replayed.

Under ``memory_budget`` the region is planned first without this pass; it then runs only in the layers whose
q, k or v that plan compressed (``PipelineState.attention_layers``): elsewhere attention's q, k, v and output stay
saved exact, and backward runs no second attention forward there (backend.py).
"""

from __future__ import annotations

import operator

from fxmem.analysis.graph import layer_of, module_path
from fxmem.analysis.roles import dropout_probability, is_fused_attention
from fxmem.cost_model.prices import attention_op_seconds
from fxmem.fallback import unsupported
from fxmem.passes.manager import GraphPass, PipelineState, tag_must_recompute


class RecomputeAttention(GraphPass):
    name = "recompute_attention"
    stage = "joint"

    def run(self, state: PipelineState) -> str:
        tagged = skipped = exact = whole = 0
        seconds = 0.0
        for node in state.joint.graph.nodes:
            if node.target is operator.getitem or not is_fused_attention(node):
                continue  # a getitem carries its op's original_aten: count the op once
            layer = layer_of(module_path(node))
            if state.blocks is not None and layer in state.blocks:
                whole += 1  # checkpoint_blocks recomputes the whole block
                continue
            if state.attention_layers is not None and layer not in state.attention_layers:
                exact += 1
                continue
            if dropout_probability(node):
                skipped += 1
                continue
            tag_must_recompute([node, *(u for u in node.users if u.target is operator.getitem)])
            tagged += 1
            seconds += attention_op_seconds(node)
        parts = []
        if tagged:
            parts.append(f"{tagged} attention op(s) recomputed in backward (about {seconds * 1000:.2f} ms of "
                         f"attention forward a step at the measured matmul rate)")
        if exact:
            parts.append(f"{exact} left saving q, k, v and the output exact (memory_budget: their q, k and v stay "
                         f"exact)")
        if whole:
            parts.append(f"{whole} in blocks memory_budget checkpoints whole")
        if skipped:
            parts.append(f"{skipped} with dropout left as is")
            unsupported(f"recompute_attention: {parts[-1]}", state.config)
        return "; ".join(parts)

