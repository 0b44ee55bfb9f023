"""Run each RMSNorm over chunks of tokens (kernels/chunked_rms_norm.py).

Runs on the graph dynamo captured, before AOTAutograd: the norm's backward then comes from the chunked op's own,
which recomputes each chunk's float32 rows from the norm's input. Neither pass holds more than one chunk of them.
The gradients are torch's sums in another order. A norm of another form is left as torch runs it.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointPolicy

from fxmem.analysis.meta import EXAMPLE_VALUE, RECOMPUTE
from fxmem.analysis.rms_norm import find_rms_norms
from fxmem.cost_model.auto import chunk_rows
from fxmem.kernels.chunked_rms_norm import chunked_rms_norm, workspace_bytes
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code, replace_with_call


class ChunkNorm(GraphPass):
    name = "chunk_norm"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.dynamo.graph
        found = find_rms_norms(graph)
        if not found:
            return PassResult(False, "no RMSNorm of Llama's form (weight * (u * rsqrt(mean(u**2) + eps))"
                                     ".to(x.dtype), u = x.to(torch.float32), over (batch, tokens, hidden))")
        norm = found[0]
        rows = chunk_rows(state.config.norm_chunk, norm.tokens, norm.hidden * norm.element_size,
                          lambda backward: workspace_bytes(1, 1, norm.hidden, norm.element_size, backward=backward))
        for each in found:
            chunked = replace_with_call(graph, each.output, chunked_rms_norm, (each.x, each.weight, each.eps, rows))
            # what dynamo traced it with, as every node of its graph carries: the dynamo passes' matchers read it
            chunked.meta[EXAMPLE_VALUE] = each.output.meta[EXAMPLE_VALUE]
            # recomputed in backward from its input, as torch's min-cut recomputes a norm of aten ops: saving the
            # output would add a tensor of the hidden width where torch's norm saves one value per row (AOTAutograd
            # copies the tag onto the op's joint node)
            chunked.meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
        eliminate_dead_code(graph)
        wide = norm.tokens * norm.hidden * 4
        note = (f"{len(found)} RMSNorm(s) of {norm.tokens} tokens x {norm.hidden} in chunks of {rows} tokens: "
                f"{wide / 2**20:.1f} MiB per float32 tensor never whole, its input the only tensor saved")
        return PassResult(True, note)
