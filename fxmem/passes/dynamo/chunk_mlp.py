"""Run each SwiGLU MLP with a LoRA on its linears over chunks of tokens (kernels/chunked_mlp.py).

Runs on the graph dynamo captured, before AOTAutograd: the MLP's backward then comes from the chunked op's own,
which recomputes each chunk's gate and up products from the MLP's input. The MLP saves only that input for
backward, and neither pass holds more than one chunk of MLP-wide tensors. Exact up to the rounding of the
chunked products. An MLP of another form is left as torch runs it.
"""

from __future__ import annotations

from fxmem.analysis.loss import example_tensor
from fxmem.analysis.mlp import LoraLinearNodes, find_swiglu_mlps
from fxmem.cost_model.auto import chunk_rows
from fxmem.kernels.chunked_lora_linear import LoraLinear
from fxmem.kernels.chunked_mlp import chunked_swiglu_mlp, workspace_bytes
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code, replace_with_call


class ChunkMlp(GraphPass):
    name = "chunk_mlp"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.dynamo.graph
        found = find_swiglu_mlps(graph)
        if not found:
            return PassResult(False, "no SwiGLU MLP with a PEFT LoRA (no dropout) on its gate, up and down "
                                     "projections, each on a frozen weight (float, or bitsandbytes 4-bit: "
                                     "dequantize_bases)")
        mlp = found[0]
        hidden = example_tensor(mlp.x).shape[-1]
        rows = chunk_rows(state.config.mlp_chunk, mlp.tokens, hidden * mlp.element_size,
                          lambda backward: workspace_bytes(1, 1, mlp.width, mlp.element_size, backward=backward))
        for each in found:
            replace_with_call(graph, each.output, chunked_swiglu_mlp,
                              (each.x, _linear(each.gate), _linear(each.up), _linear(each.down), rows))
        eliminate_dead_code(graph)
        wide = mlp.tokens * mlp.width * mlp.element_size
        note = (f"{len(found)} SwiGLU MLP(s) of {mlp.tokens} tokens x {mlp.width} in chunks of {rows} tokens: "
                f"{wide / 2**20:.1f} MiB per MLP-wide tensor never whole, its input the only tensor saved")
        return PassResult(True, note)


def _linear(nodes: LoraLinearNodes) -> LoraLinear:
    return LoraLinear(nodes.weight, nodes.a, nodes.b, nodes.scale)
