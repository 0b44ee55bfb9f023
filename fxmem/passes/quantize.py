"""Store saved activations quantized per channel, outlier channels exact (HyC-LoRA, intra-operator).

For each storage the plan quantizes, the forward calls ``fxmem::quantize_saved``
on it (in memory order, so the innermost dimension is the channel) and saves the
packed codes, outlier columns, scales, zero points, outlier ids and outlier
values with their positions instead of the tensor. The backward dequantizes
right before the first use and replays the views its saved tensors took of the
storage. For q and k after RoPE the plan
names the tensor before rotation as the source: that is what gets quantized,
and the rotation (with its small cos/sin tables saved as they are) is replayed
in backward; likewise for k and v repeated per head by grouped-query attention,
whose tensor before the repeat is quantized.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxmem.analysis.graph import memory_order
from fxmem.config import Config
from fxmem.cost_model.plan import Plan
from fxmem.kernels.calibration import QuantSlot, register
from fxmem.passes.manager import GraphPass, PipelineState
from fxmem.passes.saved_rewrite import (
    SavedTensorEditor,
    call,
    compress_storage,
    compressed_source,
    permute_back,
    rewrite_planned,
)

aten = torch.ops.aten


class QuantizeSaved(GraphPass):
    name = "quantize"
    stage = "partitioned"

    def run(self, state: PipelineState) -> str:
        slots = rewrite_planned(state, "quantize", lambda editor, members, plan: _rewrite(
            editor, members, plan, state.config))
        state.slots += slots
        return f"{len(slots)} storage(s) quantized" if slots else ""


def _rewrite(editor: SavedTensorEditor, members: list[Node], plan: Plan, config: Config) -> QuantSlot:
    source, replay = compressed_source(members, plan)
    order = memory_order(source.meta["val"])
    permuted = order != sorted(order)
    slot = QuantSlot(name=members[0].name, channels=plan.channels, bits=plan.bits, outliers=plan.outliers,
                     outlier_values=plan.outlier_values, calibration_steps=config.calibration_steps,
                     mode=config.calibration)

    def compress(graph: torch.fx.Graph, node: Node) -> list[Node]:
        if permuted:
            node = call(graph, aten.permute.default, (node, order))
        return call(graph, torch.ops.fxmem.quantize_saved.default, (node, slot_id), outputs=7)

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        restored = call(graph, torch.ops.fxmem.dequantize.default, (*parts[:5], plan.bits, *parts[5:]))
        if permuted:
            restored = permute_back(graph, restored, order)
        return restored

    slot_id = register(slot)
    compress_storage(editor, members, compress, restore, replay)
    return slot
