"""Store eager attention's probabilities pruned to the largest values of each row (HyC-LoRA, after BackRazor).

The forward keeps the ``keep`` largest probabilities of every row and their
column indices (int16 while rows are short enough); the backward scatters them
into zeros. Fused attention (SDPA, FlashAttention) never saves the map.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.fx import Node

from fxmem.analysis.graph import storage_base
from fxmem.config import Config
from fxmem.cost_model.memory import sparse_index_bytes
from fxmem.passes.manager import GraphPass, PipelineState
from fxmem.passes.saved_rewrite import SavedTensorEditor, call, compress_storage

aten = torch.ops.aten
prims = torch.ops.prims


class SparsifyAttention(GraphPass):
    name = "sparsify_attention"
    stage = "partitioned"

    def enabled(self, config: Config) -> bool:
        return config.attn_sparsity is not None

    def run(self, state: PipelineState) -> str:
        editor = SavedTensorEditor(state)
        groups: dict[str, list[Node]] = defaultdict(list)
        keep: dict[str, int] = {}
        for saved, plan in zip(state.analysis.saved, state.plans, strict=True):
            if plan.action == "sparsify":
                groups[saved.storage].append(state.analysis.nodes[saved.name])
                keep[saved.storage] = max(keep.get(saved.storage, 0), plan.keep)
        for storage, members in groups.items():
            _rewrite(editor, members, keep[storage])
        return f"{len(groups)} attention map(s) pruned" if groups else ""


def _rewrite(editor: SavedTensorEditor, members: list[Node], keep: int) -> None:
    row = storage_base(members[0]).meta["val"].shape[-1]
    index_dtype = torch.int16 if sparse_index_bytes(row) == 2 else torch.int32

    def compress(graph: torch.fx.Graph, probs: Node) -> list[Node]:
        values, indices = call(graph, aten.topk.default, (probs, keep), outputs=2)
        return [values, call(graph, prims.convert_element_type.default, (indices, index_dtype))]

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        values, indices = parts
        dense = call(graph, aten.new_zeros.default, (values, [*values.meta["val"].shape[:-1], row]))
        indices = call(graph, prims.convert_element_type.default, (indices, torch.int64))
        return call(graph, aten.scatter.src, (dense, -1, indices, values))

    compress_storage(editor, members, compress, restore)
