"""Store saved activations quantized per channel, outlier channels and values exact (HyC-LoRA, intra-operator).

For each storage the plan quantizes, the forward computes ``fxmem.kernels.quantize.quantize`` of it right after
the op that produced it (in memory order, so the innermost dimension is the channel) and saves the packed codes,
scales, zero points and outliers instead of the tensor; the backward computes ``dequantize`` right before the
first use and replays the views its saved tensors took of the storage. Both are traced into the graphs as aten
ops: inductor generates the statistics, codes and packing inside the producer's kernel and the unpacking,
scaling and outlier merge inside the consumer's, with no host synchronisation and no data-dependent shape.

A norm input planned ``prenorm`` on an output quantized here (cost_model.planner.fit_ceilings) is rebuilt
from the output's restored value, as the lowrank pass does from factors (saved_rewrite.rebuild_norm_input).

For q and k after RoPE the plan names the tensor before rotation as the source: that is what gets quantized,
and the rotation (with its small cos/sin tables saved as they are) is replayed in backward; likewise for k and
v repeated per head by grouped-query attention, whose tensor before the repeat is quantized.
"""

from __future__ import annotations

import torch
from torch.fx import Node

from fxmem.analysis.graph import memory_order
from fxmem.cost_model.plan import Action, Plan
from fxmem.kernels import quantize as kernel
from fxmem.kernels.calibration import QuantSlot, register, release
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, pass_result
from fxmem.passes.saved_rewrite import (
    SavedTensorEditor,
    call,
    compress_storage,
    compressed_source,
    permute_back,
    rebuild_norm_input,
    rewrite_planned,
    trace_into,
)

aten = torch.ops.aten


class QuantizeSaved(GraphPass):
    name = "quantize"
    stage = "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        restored: dict[Node, list[Node]] = {}  # forward storage -> the backward nodes that restore it, last = value
        done = rewrite_planned(state, Action.QUANTIZE, lambda editor, members, plan: _rewrite(
            editor, members, plan, state, restored))
        shared = rewrite_planned(state, Action.PRENORM, lambda editor, members, plan: rebuild_norm_input(
            editor, members, plan, restored), where=lambda plan: plan.bits is not None)
        parts = [f"{len(done)} storage(s) quantized" if done else "",
                 f"{len(shared)} norm input(s) rebuilt from their output's codes" if shared else ""]
        return pass_result(bool(done or shared), *parts)


def _rewrite(editor: SavedTensorEditor, members: list[Node], plan: Plan, state: PipelineState,
             restored: dict[Node, list[Node]]) -> QuantSlot | None:
    """Quantize one storage, recording the backward nodes that restore it; its calibration slot under static
    calibration."""
    config = state.config
    source, replay = compressed_source(members, plan)
    val = source.meta["val"]
    order = memory_order(val)
    permuted = order != sorted(order)
    spec = kernel.QuantSpec(plan.channels, plan.bits, plan.outliers, plan.chunk, plan.rotation, plan.stochastic,
                            plan.keep_positive)
    slot = None
    if config.calibration == "static":
        slot = QuantSlot(name=members[0].name, channels=plan.channels, bits=plan.bits, outliers=plan.outliers,
                         calibration_steps=config.calibration_steps)
    slot_id = register(slot) if slot is not None else None

    split = [val.shape[d] for d in order[len(order) - plan.merged:]] if plan.merged else []  # static sizes

    def compress(graph: torch.fx.Graph, node: Node) -> list[Node]:
        if permuted:
            node = call(graph, aten.permute.default, (node, order))
        if plan.merged:
            node = call(graph, aten.flatten.using_ints, (node, -plan.merged, -1))
        return trace_into(graph, lambda x: kernel.quantize(x, spec, slot_id), [node])

    def restore(graph: torch.fx.Graph, parts: list[Node]) -> Node:
        existing = set(graph.nodes)
        [value] = trace_into(graph, lambda *saved: kernel.dequantize(saved, spec, val.dtype), parts)
        state.dequantized[value] = (*parts[:3], spec)
        if plan.merged:
            value = call(graph, aten.unflatten.int, (value, -1, split))
        if permuted:
            value = permute_back(graph, value, order)
        restored[source] = [n for n in graph.nodes if n not in existing and n is not value] + [value]
        return value

    try:
        compress_storage(editor, members, compress, restore, replay)
    except Exception:
        if slot is not None:  # no graph names it
            release([slot])
        raise
    if slot is not None:  # at once: a rollback of the stage releases what its state lists (passes/manager.py)
        state.slots.append(slot)
    return slot
