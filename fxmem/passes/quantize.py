"""Store saved activations quantized per channel, outlier channels exact (HyC-LoRA, intra-operator).

For each storage the plan quantizes, the forward calls ``fxmem::quantize_saved``
on it (in memory order, so the innermost dimension is the channel) and saves the
packed codes, outlier columns, scales, zero points and outlier ids instead of the
tensor. The backward dequantizes right before the first use and replays the
views its saved tensors took of the storage. For q and k after RoPE the plan
names the tensor before rotation as the source: that is what gets quantized,
and the rotation (with its small cos/sin tables saved as they are) is replayed
in backward.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.fx import Node

from fxmem.analysis.graph import memory_order, storage_base
from fxmem.analysis.rope import rope_recompute
from fxmem.calibration import QuantSlot, register
from fxmem.config import Config
from fxmem.passes.manager import GraphPass, PipelineState
from fxmem.passes.saved_rewrite import SavedTensorEditor, Unmappable, call, compress_storage
from fxmem.policy import Plan

aten = torch.ops.aten


class QuantizeSaved(GraphPass):
    name = "quantize"
    stage = "partitioned"

    def enabled(self, config: Config) -> bool:
        return config.bits is not None

    def run(self, state: PipelineState) -> str:
        editor = SavedTensorEditor(state)
        groups: dict[str, list[int]] = defaultdict(list)
        for index, (saved, plan) in enumerate(zip(state.analysis.saved, state.plans, strict=True)):
            if plan.action == "quantize":
                groups[saved.storage].append(index)
        done = 0
        for indices in groups.values():
            members = [state.analysis.nodes[state.analysis.saved[i].name] for i in indices]
            owner_plan = next(state.plans[i] for i in indices if state.plans[i].nbytes is not None)
            try:
                slot = _rewrite(editor, members, owner_plan, state.config)
            except Unmappable as error:
                for i in indices:
                    state.plans[i] = Plan("keep", f"not quantized: {error}")
                continue
            state.slots.append(slot)
            done += 1
        return f"{done} storage(s) quantized" if done else ""


def _rewrite(editor: SavedTensorEditor, members: list[Node], plan: Plan, config: Config) -> QuantSlot:
    rope = rope_recompute(storage_base(members[0])) if plan.source is not None else None
    source = rope.source if rope is not None else storage_base(members[0])
    order = memory_order(source.meta["val"])
    permuted = order != sorted(order)
    slot = QuantSlot(name=members[0].name, channels=plan.channels, bits=plan.bits, outliers=plan.outliers,
                     calibration_steps=config.calibration_steps, dynamic=config.calibration == "dynamic")

    def compress(graph: torch.fx.Graph, node: Node) -> list[Node]:
        if permuted:
            node = call(graph, aten.permute.default, (node, order))
        return call(graph, torch.ops.fxmem.quantize_saved.default, (node, slot_id), outputs=5)

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        restored = call(graph, torch.ops.fxmem.dequantize.default, (*parts, plan.bits))
        if permuted:
            restored = call(graph, aten.permute.default, (restored, sorted(range(len(order)), key=order.__getitem__)))
        return restored

    slot_id = register(slot)
    compress_storage(editor, members, compress, restore, rope)
    return slot
