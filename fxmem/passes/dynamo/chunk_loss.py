"""Replace the LM head and its cross-entropy with the chunked loss (kernels/linear_cross_entropy.py).

Runs on the graph dynamo captured, before AOTAutograd: the loss's backward then comes from the chunked op's own
autograd formula, and neither pass of the step holds more than one chunk of logits. The rewrite is exact. A loss
fxmem does not chunk is left as torch runs it, and the summary says why.

A model that returns its logits (a forward output: every HF ``...ForCausalLM``) needs them whole anyway, and
chunking the loss beside them would cost a third head matmul: such a loss is chunked only with
``return_logits=False``, where the forward returns an empty tensor in their place.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from fxmem.analysis.loss import HeadLoss, UnchunkedLoss, find_head_losses
from fxmem.cost_model.loss import LossChunks, logits_bytes, loss_chunks
from fxmem.kernels.linear_cross_entropy import linear_cross_entropy
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code, pass_result

LOGITS_RETURNED = ("the logits are also a forward output (the model returns them); return_logits=False returns "
                   "an empty tensor in their place and chunks the loss")


class ChunkLoss(GraphPass):
    name = "chunk_loss"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        lines, chunked = [], 0
        for found in find_head_losses(state.dynamo.graph):
            if isinstance(found, HeadLoss) and found.logits_outputs and state.config.return_logits:
                found = UnchunkedLoss(found.loss, LOGITS_RETURNED)
            if isinstance(found, UnchunkedLoss):
                # named in the summary, not raised in strict mode: most such losses (a classifier's, one over logits
                # the model returns) have no vocabulary-wide transient to chunk
                lines.append(f"{found.loss.name} left as torch runs it: {found.reason}")
                continue
            chunks = loss_chunks(found.tokens, found.vocab, found.hidden, found.element_size,
                                 head_trains=found.head_trains, device_type=found.device_type)
            _rewrite(state.dynamo, found, chunks)
            chunked += 1
            lines.append(f"{found.loss.name}: {found.tokens} tokens x {found.vocab} vocabulary in "
                         f"{chunks.describe(found.tokens, found.vocab)}; "
                         f"{logits_bytes(found.tokens, found.vocab) / 2**20:.1f} MiB of float32 logits never whole")
        if chunked:  # the head's matmul and the logits' reshapes, now unused
            eliminate_dead_code(state.dynamo.graph)
        return pass_result(chunked > 0, *lines)


def _rewrite(gm: GraphModule, found: HeadLoss, chunks: LossChunks) -> None:
    graph = gm.graph
    with graph.inserting_before(found.loss):
        x = graph.call_method("reshape", (found.x, (-1, found.hidden)))
        for logits in found.logits_outputs:  # return_logits=False: an empty tensor in their place
            value = logits.meta["example_value"]
            empty = graph.call_function(torch.empty, (0,), {"dtype": value.dtype, "device": value.device})
            (output,) = [user for user in logits.users if user.op == "output"]
            output.replace_input_with(logits, empty)
        chunked = graph.call_function(linear_cross_entropy, (x, found.weight, found.target), {
            "lora": found.lora, "ignore_index": found.ignore_index, "reduction": found.reduction,
            "logits_dtype": found.logits_dtype, "chunk_rows": chunks.rows, "vocab_chunk": chunks.vocab})
    found.loss.replace_all_uses_with(chunked)
    graph.erase_node(found.loss)
