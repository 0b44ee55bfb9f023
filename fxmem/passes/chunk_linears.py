"""Run the PEFT LoRA linears that read one input as one op over chunks of tokens
(kernels/chunked_lora_linear.py): an attention's q, k and v projections, and its o projection.

Runs on the graph dynamo captured, before AOTAutograd (after chunk_mlp, which takes an MLP's linears whole): the
linears' backward then comes from the chunked op's own, which adds each chunk's terms of d x into one buffer and
holds one chunk of float32 adapter rows. They save only their input for backward. Exact up to the rounding of the
chunked products (the adapters' terms of d x are summed in float32 before their one cast). A linear of another
form is left as torch runs it.
"""

from __future__ import annotations

import operator

from fxmem.analysis.linear_groups import find_lora_linear_groups, last_operand
from fxmem.analysis.meta import EXAMPLE_VALUE, MODULE_STACK
from fxmem.kernels.chunked_lora_linear import LoraLinear, chunked_lora_linears
from fxmem.passes.manager import GraphPass, PipelineState


class ChunkLinears(GraphPass):
    name = "chunk_linears"
    stage = "dynamo"

    def run(self, state: PipelineState) -> str:
        rows = state.config.linear_chunk
        graph = state.dynamo.graph
        groups = find_lora_linear_groups(graph)
        for group in groups:
            linears = [LoraLinear(n.weight, n.a, n.b, n.scale) for n in group.linears]
            with graph.inserting_after(last_operand(group)):
                call = graph.call_function(chunked_lora_linears, (group.x, linears, rows))
            call.meta[MODULE_STACK] = dict(group.outputs[0].meta.get(MODULE_STACK, {}))
            for index, output in enumerate(group.outputs):
                with graph.inserting_after(call):
                    item = graph.call_function(operator.getitem, (call, index))
                # what dynamo traced the output with and its module, as every node of its graph carries: the
                # dynamo passes' matchers and checkpoint_blocks read them
                item.meta[EXAMPLE_VALUE] = output.meta[EXAMPLE_VALUE]
                item.meta[MODULE_STACK] = dict(output.meta.get(MODULE_STACK, {}))
                output.replace_all_uses_with(item)
        if not groups:
            return ("no PEFT LoRA linear (no dropout) on a frozen float weight (a bitsandbytes 4-bit base is not read), "
                    "outside a chunked MLP")
        graph.eliminate_dead_code()
        sizes = ", ".join(str(len(group.linears)) for group in groups)
        group = groups[0]
        return (f"{sum(len(g.linears) for g in groups)} LoRA linear(s) in {len(groups)} op(s) of one input each "
                f"({sizes} linears), {group.tokens} tokens in chunks of {rows}: each group's input the only tensor "
                "it saves, its d x one buffer")
