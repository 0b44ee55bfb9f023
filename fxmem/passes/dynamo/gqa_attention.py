"""Run grouped-query attention with SDPA's ``enable_gqa`` instead of key and value heads repeated for it
(analysis/gqa.py).

Runs on the graph dynamo captured, after causal_mask (``enable_gqa`` takes no mask on a GPU's flash kernel, and HF
repeats the heads only where it passes one). The key and value SDPA reads and returns gradients for are then the
model's own, n_rep times fewer bytes than the copies (torch's min-cut saved the heads before the copies already, and
copied them again in backward: the copies and their gradients are what is gone). Exact: the same heads meet; in
half precision the kernel sums a key's gradient over its query heads in another order (within the difference eager
PEFT, whose SDPA takes enable_gqa without a mask, has from torch.compile; measured: docs/long-context.md). Applied
to each call only where SDPA runs a fused kernel for it (flash attention; torch's other fused kernels refuse
``enable_gqa`` and its math kernel builds the tokens x tokens scores), else the call is left as HF wrote it.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.nn.attention import SDPBackend

from fxmem.analysis.gqa import RepeatedHeadsAttention, find_repeated_heads_attention
from fxmem.analysis.graph import hint
from fxmem.analysis.loss import example_tensor
from fxmem.analysis.mask import SDPA_PARAMETERS, sdpa_arguments
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code, pass_result


class GqaAttention(GraphPass):
    name = "gqa_attention"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        found = find_repeated_heads_attention(state.dynamo.graph)
        if not found:
            return PassResult(False, "no attention with repeated key and value heads (and no mask)")
        backends = {match.attention: _backend(match) for match in found}
        rewritten = [m for m in found if backends[m.attention] is not None]
        for match in rewritten:
            arguments = sdpa_arguments(match.attention) | {"key": match.key, "value": match.value,
                                                           "enable_gqa": True}
            match.attention.args = tuple(arguments.pop(name) for name in SDPA_PARAMETERS[:3])
            match.attention.kwargs = arguments
        lines = []
        if rewritten:
            eliminate_dead_code(state.dynamo.graph)
            names = ", ".join(sorted({backends[m.attention] for m in rewritten}))
            lines.append(f"{len(rewritten)} attention call(s) read each key and value head once with enable_gqa "
                         f"({names}), not {rewritten[0].repeats} copies of it")
        if len(rewritten) < len(found):
            lines.append(f"{len(found) - len(rewritten)} attention call(s) keep their repeated key and value heads: "
                         "SDPA has no fused kernel with enable_gqa for their device, dtype and head size")
        return pass_result(bool(rewritten), *lines)


def _backend(match: RepeatedHeadsAttention) -> str | None:
    arguments = sdpa_arguments(match.attention)
    return fused_gqa_backend(example_tensor(arguments["query"]), example_tensor(match.key),
                             float(arguments.get("dropout_p", 0.0)), bool(arguments.get("is_causal", False)))


def fused_gqa_backend(query: torch.Tensor | None, key: torch.Tensor | None, dropout_p: float,
                      is_causal: bool) -> str | None:
    """The fused kernel SDPA runs for these (fake) query and key heads with ``enable_gqa``, asked with a few tokens
    of real tensors on their device, needing gradients as they do (a kernel's limits depend on it); None for its
    math kernel or where the choice cannot be asked."""
    if query is None or key is None:
        return None
    with unset_fake_temporarily():
        q = torch.empty(1, hint(query.shape[1]), 8, hint(query.shape[-1]), dtype=query.dtype, device=query.device,
                        requires_grad=query.requires_grad)
        k = torch.empty(1, hint(key.shape[1]), 8, hint(key.shape[-1]), dtype=key.dtype, device=key.device,
                        requires_grad=key.requires_grad)
        choice = SDPBackend(torch._fused_sdp_choice(q, k, k, None, dropout_p, is_causal, scale=None,
                                                    enable_gqa=True))
    return None if choice in (SDPBackend.MATH, SDPBackend.ERROR) else choice.name.lower()
