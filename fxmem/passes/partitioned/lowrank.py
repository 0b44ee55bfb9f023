"""Store saved activations as low-rank factors (LoRAct), and RMSNorm inputs as nothing of their own.

Layer-wise: for each storage the plan marks ``lowrank``, the forward views it
as a (rows, last dimension) matrix in memory order, as the paper's code
flattens (batch, seq, hidden), calls ``fxmem::lowrank_decompose_rows`` and
saves U and V; the backward rebuilds U @ V (``fxmem::lowrank_rebuild_rows``)
right before the first use and replays the views its saved tensors took. For q
and k after RoPE, and k and v after GQA's repeat, the factors are of the tensor
before, and the rotation and repeat are replayed in backward, as the quantize
pass does. The
rank is fixed from the last dimension, which is static, so a symbolic row count
adds no guard, and the ops flatten themselves, so no size enters the graph.

Pre-norm sharing (section 3.3, equations 8-10): for a storage marked
``prenorm`` (what a norm's backward saves, its output stored as factors) the
forward saves only the channels with the smallest |gamma| and their ids, plus
the per-row rstd if backward did not keep it already. The backward rebuilds
RMSNorm's input as output / gamma / rstd, or LayerNorm's x_hat as (output -
beta) / gamma, from the output's rebuilt factors, then writes the exact
channels back, so channels where gamma == 0 (whose output carries nothing
about them) come back exactly. The norm's own backward then runs as traced:
equations 9 and 10 are what it computes from that value.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxmem.analysis.graph import memory_order, storage_base
from fxmem.cost_model.plan import Action, Plan
from fxmem.kernels.lowrank import DEFAULT_NITER
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, pass_result
from fxmem.passes.saved_rewrite import (
    SavedTensorEditor,
    call,
    compress_storage,
    compressed_source,
    permute_back,
    rebuild_norm_input,
    rewrite_planned,
)

aten = torch.ops.aten

# LoRAct's sampling-based decomposition (Algorithm 1): as accurate as a randomized SVD at equal rank here
# (docs/loract.md), without the Gaussian draw.
METHOD = "sampling"


class LowRankSaved(GraphPass):
    name = "lowrank"
    stage = "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        rebuilt: dict[Node, list[Node]] = {}  # forward storage -> the backward nodes that rebuild it, last = value
        factored = rewrite_planned(state, Action.LOWRANK, lambda editor, members, plan: _factor(
            editor, members, plan, rebuilt))
        shared = rewrite_planned(state, Action.PRENORM, lambda editor, members, plan: rebuild_norm_input(
            editor, members, plan, rebuilt), where=lambda plan: plan.rank > 0)
        parts = [f"{len(factored)} storage(s) stored as low-rank factors" if factored else "",
                 f"{len(shared)} norm input(s) rebuilt from their output's factors" if shared else ""]
        return pass_result(bool(factored or shared), *parts)


def _factor(editor: SavedTensorEditor, members: list[Node], plan: Plan, rebuilt: dict[Node, list[Node]]) -> Node:
    source, replay = compressed_source(members, plan)
    val = source.meta["val"]
    order = memory_order(val)
    permuted = order != sorted(order)

    def compress(graph: torch.fx.Graph, node: Node) -> list[Node]:
        if permuted:  # the last dimension in memory is the one the rank is a share of
            node = call(graph, aten.permute.default, (node, order))
            node = call(graph, aten.clone.default, (node,), kwargs={"memory_format": torch.contiguous_format})
        return call(graph, torch.ops.fxmem.lowrank_decompose_rows.default, (node, plan.rank, DEFAULT_NITER, METHOD),
                    outputs=2)

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        nodes = [call(graph, torch.ops.fxmem.lowrank_rebuild_rows.default, tuple(parts))]
        if permuted:
            nodes.append(permute_back(graph, nodes[-1], order))
        rebuilt[source] = nodes
        return nodes[-1]

    compress_storage(editor, members, compress, restore, replay)
    return storage_base(members[0])
