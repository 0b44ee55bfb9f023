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
from fxmem.cost_model.plan import Plan
from fxmem.kernels.lowrank import DEFAULT_NITER
from fxmem.passes.manager import GraphPass, PipelineState
from fxmem.passes.saved_rewrite import (
    SavedTensorEditor,
    Unmappable,
    call,
    compress_storage,
    compressed_source,
    permute_back,
    rewrite_planned,
)

aten = torch.ops.aten
prims = torch.ops.prims

# LoRAct's sampling-based decomposition (Algorithm 1): as accurate as a randomized SVD at equal rank here
# (docs/loract.md), without the Gaussian draw.
METHOD = "sampling"


class LowRankSaved(GraphPass):
    name = "lowrank"
    stage = "partitioned"

    def run(self, state: PipelineState) -> str:
        rebuilt: dict[Node, list[Node]] = {}  # forward storage -> the backward nodes that rebuild it, last = value
        factored = rewrite_planned(state, "lowrank", lambda editor, members, plan: _factor(
            editor, members, plan, rebuilt))
        shared = rewrite_planned(state, "prenorm", lambda editor, members, plan: _share_prenorm(
            editor, members, plan, rebuilt))
        parts = [f"{len(factored)} storage(s) stored as low-rank factors" if factored else "",
                 f"{len(shared)} norm input(s) rebuilt from their output's factors" if shared else ""]
        return "; ".join(p for p in parts if p)


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


def _share_prenorm(editor: SavedTensorEditor, members: list[Node], plan: Plan,
                   rebuilt: dict[Node, list[Node]]) -> Node:
    unit = plan.norm
    if unit.output not in rebuilt:
        raise Unmappable(f"its norm output {unit.output.name} was not stored as factors")
    output_nodes = rebuilt[unit.output]
    first_use = editor.first_backward_use([editor.placeholder_of[m] for m in members])
    position = {n: i for i, n in enumerate(editor.bw.graph.nodes)}
    if position[output_nodes[-1]] > position[first_use]:
        for node in output_nodes:  # they read only U and V (placeholders): safe to move earlier
            first_use.prepend(node)
    compute_dtype = unit.normalized.meta["val"].dtype
    x_dtype = unit.x.meta["val"].dtype

    # Index the last dimension with aten.index / index_put: index_select and index_copy are decomposed away
    # before partitioning, and inductor refuses them in the rewritten graph.
    leading = [None] * (unit.x.meta["val"].dim() - 1)

    def compress(graph: torch.fx.Graph, x: Node) -> list[Node]:
        magnitude = call(graph, aten.abs.default, (unit.gamma,))
        _, ids = call(graph, aten.topk.default, (magnitude, plan.exact_channels, -1, False), outputs=2)
        return [call(graph, aten.index.Tensor, (x, [*leading, ids])), ids]

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        exact, ids = parts
        # Saved only now, once compress_storage has checked that backward can rebuild the members: parameters
        # cost nothing to keep, and rstd only what the plan priced.
        output = _cast(graph, output_nodes[-1], compute_dtype)
        if unit.beta is not None:
            output = call(graph, aten.sub.Tensor, (output, _cast(graph, editor.save(unit.beta), compute_dtype)))
        weight = _cast(graph, editor.save(unit.gamma), compute_dtype)
        # gamma == 0 divides by 1 instead: those channels are written back from the exact copy below
        nonzero = call(graph, aten.add.Tensor, (weight, call(graph, aten.eq.Scalar, (weight, 0))))
        x = call(graph, aten.div.Tensor, (output, nonzero))
        if unit.rstd is not None:
            x = call(graph, aten.div.Tensor, (x, editor.save(unit.rstd)))
        x = _cast(graph, x, x_dtype)
        return call(graph, aten.index_put.default, (x, [*leading, ids], exact))

    compress_storage(editor, members, compress, restore)
    return unit.x


def _cast(graph: torch.fx.Graph, node: Node, dtype: torch.dtype) -> Node:
    if node.meta["val"].dtype == dtype:
        return node
    return call(graph, prims.convert_element_type.default, (node, dtype))
