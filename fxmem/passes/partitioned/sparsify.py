"""Store eager attention's probabilities pruned to the largest values of each row (HyC-LoRA, after BackRazor).

The forward keeps the ``keep`` largest probabilities of every row and their
column indices (int16 while rows are short enough); the backward scatters them
into zeros. Fused attention (SDPA, FlashAttention) never saves the map.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxmem.analysis.graph import storage_base
from fxmem.cost_model.memory import sparse_index_bytes
from fxmem.cost_model.plan import Action, Plan
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState
from fxmem.passes.saved_rewrite import SavedTensorEditor, call, compress_storage, rewrite_planned

aten = torch.ops.aten
prims = torch.ops.prims


class SparsifyAttention(GraphPass):
    name = "sparsify_attention"
    stage = "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        pruned = rewrite_planned(state, Action.SPARSIFY, _rewrite)
        return PassResult(True, f"{len(pruned)} attention map(s) pruned") if pruned else UNCHANGED


def _rewrite(editor: SavedTensorEditor, members: list[Node], plan: Plan) -> Node:
    keep = plan.kept_per_row
    row = storage_base(members[0]).meta["val"].shape[-1]
    index_dtype = torch.int16 if sparse_index_bytes(row) == 2 else torch.int32

    def compress(graph: torch.fx.Graph, probs: Node) -> list[Node]:
        values, indices = call(graph, aten.topk.default, (probs, keep), outputs=2)
        return [values, call(graph, prims.convert_element_type.default, (indices, index_dtype))]

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        values, indices = parts
        like = values.meta["val"]  # aten.full, not new_zeros: inductor lowers it (new_zeros is decomposed away)
        dense = call(graph, aten.full.default, ([*like.shape[:-1], row], 0.0),
                     kwargs={"dtype": like.dtype, "layout": torch.strided, "device": like.device,
                             "pin_memory": False})
        indices = call(graph, prims.convert_element_type.default, (indices, torch.int64))
        return call(graph, aten.scatter.src, (dense, -1, indices, values))

    compress_storage(editor, members, compress, restore)
    return members[0]
