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

from torch.fx import Node

from fxmem.analysis.linear_groups import LoraLinearGroup, find_lora_linear_groups
from fxmem.analysis.loss import example_tensor
from fxmem.analysis.meta import EXAMPLE_VALUE, MODULE_STACK
from fxmem.cost_model.auto import chunk_rows
from fxmem.kernels.chunked_lora_linear import LoraLinear, chunked_lora_linears, workspace_bytes
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code


class ChunkLinears(GraphPass):
    name = "chunk_linears"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.dynamo.graph
        groups, other_dtype = find_lora_linear_groups(graph)
        replaced: dict[Node, Node] = {}  # an output already rewritten, and the item that now stands for it
        sizes = []
        for group in groups:
            linears = [LoraLinear(n.weight, n.a, n.b, n.scale) for n in group.linears]
            rows = _rows(state.config.linear_chunk, group)
            sizes.append(rows)
            with graph.inserting_after(group.after):
                call = graph.call_function(chunked_lora_linears, (replaced.get(group.x, group.x), linears, rows))
            # what dynamo traced each value with and its module, as every node of its graph carries: the dynamo
            # passes' matchers and checkpoint_blocks read them
            call.meta[EXAMPLE_VALUE] = [output.meta[EXAMPLE_VALUE] for output in group.outputs]
            call.meta[MODULE_STACK] = dict(group.outputs[0].meta.get(MODULE_STACK, {}))
            previous = call
            for index, output in enumerate(group.outputs):
                with graph.inserting_after(previous):
                    item = previous = graph.call_function(operator.getitem, (call, index))
                item.meta[EXAMPLE_VALUE] = output.meta[EXAMPLE_VALUE]
                item.meta[MODULE_STACK] = dict(output.meta.get(MODULE_STACK, {}))
                output.replace_all_uses_with(item)
                replaced[output] = item
        left = (f"; {other_dtype} LoRA linear(s) left whole, their output or base weight in another dtype than "
                "their input (as under autocast)") if other_dtype else ""
        if not groups:
            return PassResult(False, "no PEFT LoRA linear (no dropout) on a frozen weight (float, or bitsandbytes "
                                     f"4-bit: dequantize_bases), outside a chunked MLP{left}")
        eliminate_dead_code(graph)
        counts = ", ".join(str(len(group.linears)) for group in groups)
        chunks = "/".join(map(str, sorted(set(sizes))))
        note = (f"{sum(len(g.linears) for g in groups)} LoRA linear(s) in {len(groups)} op(s) of one input each "
                f"({counts} linears), {groups[0].tokens} tokens in chunks of {chunks}: each group's input the only "
                f"tensor it saves, its d x one buffer{left}")
        return PassResult(True, note)


def _rows(setting: int | str, group: LoraLinearGroup) -> int:
    """The group's tokens per chunk (cost_model.auto.chunk_rows), its workspace from the kernel's model."""
    x = example_tensor(group.x)
    widths = [example_tensor(output).shape[-1] for output in group.outputs]
    rank = max(example_tensor(linear.a).shape[0] for linear in group.linears)
    return chunk_rows(setting, group.tokens, x.shape[-1] * x.element_size(),
                      lambda backward: workspace_bytes(1, 1, x.shape[-1], widths, rank, x.element_size(),
                                                       backward=backward))
