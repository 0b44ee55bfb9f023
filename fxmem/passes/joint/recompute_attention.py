"""Recompute attention in backward from its compressed q, k, v instead of saving its output or probabilities.

Fused attention's backward reads its forward output O in D = rowsum(dO * O),
which must equal sum_j P_ij dP_ij for the softmax gradient's rows to sum to
zero. Once q, k or v are stored quantized or as low-rank factors, the P and dP backward recomputes no
longer match the saved, exact O; the mismatch lands on the key and query
gradients, which are small differences, so a small mismatch bends them far
(measured: docs/quantization.md). Tagging the attention op as
must-recompute makes min-cut save q, k, v (which the quantize or lowrank pass
then compresses) and rerun the forward in backward on the very values backward
uses: consistent, and O and its log-sum-exp are no longer saved at all. The
price is one more attention forward per layer in backward, priced in the summary at the device's measured
matmul rate. Attention with dropout is left alone: its random mask would not be replayed.

Under ``memory_budget`` the region is planned first without this pass; it then runs only in the layers whose
q, k or v that plan compressed (``PipelineState.attention_layers``): elsewhere attention's q, k, v and output stay
saved exact, and backward runs no second attention forward there (backend.py).

Eager attention (matmul, softmax, matmul: a model's own, as Gemma-2's soft-capped logits need) saves its
probabilities, heads x tokens x tokens a layer. Here the chain from the scores' matmul q k^T to the softmax
(analysis/eager_attention.py: scale, mask, soft-capping, sliding window, a sink column, a row's max) is tagged
instead, so that backward rebuilds the probabilities from the q and k it keeps for their own gradients, as fused
attention does: nothing of the tokens x tokens map is saved, and what it is rebuilt from is bounded like any q and
k. Where ``attn_sparsity`` is set the probabilities stay saved, for it to prune.
"""

from __future__ import annotations

import operator

from torch.fx import Node

from fxmem.analysis.blocks import draws_random_numbers
from fxmem.analysis.eager_attention import eager_attention_chains
from fxmem.analysis.graph import layer_of, module_path, tensor_val
from fxmem.analysis.ops import dropout_probability, is_fused_attention
from fxmem.cost_model.prices import attention_op_seconds, forward_seconds
from fxmem.fallback import unsupported
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, pass_result, tag_must_recompute


class RecomputeAttention(GraphPass):
    name = "recompute_attention"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        tagged = skipped = exact = whole = 0
        seconds = 0.0

        def chosen(node: Node) -> bool:
            """Whether ``node``'s layer recomputes its attention here (else counted where it goes)."""
            nonlocal exact, whole
            layer = layer_of(module_path(node))
            if state.blocks is not None and layer in state.blocks:
                whole += 1  # checkpoint_blocks recomputes the whole block
                return False
            if state.attention_layers is not None and layer not in state.attention_layers:
                exact += 1
                return False
            return True

        for node in state.joint.graph.nodes:
            if node.target is operator.getitem or not is_fused_attention(node) or not chosen(node):
                continue  # a getitem carries its op's original_aten: count the op once
            if dropout_probability(node):
                skipped += 1
                continue
            tag_must_recompute([node, *(u for u in node.users if u.target is operator.getitem)])
            tagged += 1
            seconds += attention_op_seconds(node)
        chains, unreplayable = eager_attention_chains(state.joint.graph)
        if state.config.attn_sparsity is not None:  # the probabilities stay saved, for it to prune
            chains, unreplayable = [], 0
        eager = [attention for attention in chains if chosen(attention.probabilities)]
        eager_seconds = 0.0
        for attention in eager:
            tag_must_recompute(attention.chain)
            eager_seconds += forward_seconds(attention.chain, tensor_val(attention.scores).device.type)
        parts = []
        if tagged:
            parts.append(f"{tagged} attention op(s) recomputed in backward (about {seconds * 1000:.2f} ms of "
                         f"attention forward a step at the measured matmul rate)")
        if eager:
            parts.append(f"{len(eager)} eager attention probabilities rebuilt in backward from q and k (about "
                         f"{eager_seconds * 1000:.2f} ms a step at the measured matmul rate and memory bandwidth)")
        if exact:
            parts.append(f"{exact} left saving q, k, v and the output exact (memory_budget: their q, k and v stay "
                         f"exact)")
        if whole:
            parts.append(f"{whole} in blocks memory_budget checkpoints whole")
        if skipped:
            parts.append(f"{skipped} with dropout left as is")
            unsupported(f"recompute_attention: {parts[-1]}", state.config)
        if unreplayable:
            parts.append(f"{unreplayable} eager attention(s) with dropout from a stateful generator left saving their "
                         "probabilities")
            unsupported(f"recompute_attention: {parts[-1]}", state.config)
        # an eager attention's dropout drawn from the step's seeds is drawn again with its chain in backward
        redraws = any(draws_random_numbers(n) for attention in eager for n in attention.chain)
        return pass_result(bool(tagged or eager), *parts, redraws=redraws)
