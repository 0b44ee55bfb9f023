"""Run attention with SDPA's ``is_causal=True`` where its mask is proven causal (analysis/mask.py).

Runs on the graph dynamo captured, before AOTAutograd: the tokens x tokens mask is then never built, nor saved
for backward, and SDPA takes its causal path (on a GPU, flash attention, which refuses an explicit mask). The
rewrite is exact: the same positions are masked. A mask not proven causal is left as torch builds it, and the
summary says why.
"""

from __future__ import annotations

from fxmem.analysis.mask import SDPA_PARAMETERS, CausalMask, find_attention_masks, sdpa_arguments
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code, pass_result


class CausalMaskAttention(GraphPass):
    name = "causal_mask"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        lines, rewritten = [], False
        for found in find_attention_masks(state.dynamo):
            if not isinstance(found, CausalMask):
                lines.append(f"mask {found.mask.name} of {len(found.attention)} attention call(s) left as torch "
                             f"builds it: {found.reason}")
                continue
            for node in found.attention:
                arguments = sdpa_arguments(node) | {"attn_mask": None, "is_causal": True}
                node.args = tuple(arguments.pop(name) for name in SDPA_PARAMETERS[:3])
                node.kwargs = arguments
            rewritten = True
            lines.append(f"mask {found.mask.name} {' x '.join(map(str, found.shape))} proven causal: "
                         f"{len(found.attention)} attention call(s) run with is_causal=True, the mask never built")
        if rewritten:
            eliminate_dead_code(state.dynamo.graph)
        return pass_result(rewritten, *lines)
