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
price is one more attention forward per layer in backward. Attention with
dropout is left alone: its random mask would not be replayed.
"""

from __future__ import annotations

import operator

from fxmem.analysis.roles import dropout_probability, is_fused_attention
from fxmem.passes.manager import GraphPass, PipelineState, tag_must_recompute


class RecomputeAttention(GraphPass):
    name = "recompute_attention"
    stage = "joint"

    def run(self, state: PipelineState) -> str:
        tagged = skipped = 0
        for node in state.joint.graph.nodes:
            if node.target is operator.getitem or not is_fused_attention(node):
                continue  # a getitem carries its op's original_aten: count the op once
            if dropout_probability(node):
                skipped += 1
                continue
            tag_must_recompute([node, *(u for u in node.users if u.target is operator.getitem)])
            tagged += 1
        parts = [f"{tagged} attention op(s) recomputed in backward"] if tagged else []
        if skipped:
            parts.append(f"{skipped} with dropout left as is")
        return "; ".join(parts)
