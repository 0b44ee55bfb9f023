"""Move each checkpointed block's stored input to host memory between forward and backward (block_offload).

The planner marks the plans (cost_model/planner.offload_block_inputs); this moves what each stores: the saved
tensor itself where it is kept exact, or the tensors the quantize or lowrank pass saved in its place. Forward
copies each to host memory after its last forward reader and saves the copy; backward copies it back to the
device before its first reader. Both copies are ``prims.device_put``, as torch's own activation offloading
inserts them (torch/_functorch/_activation_offloading), and run on the compute stream in the graph's order: the
device holds one block's input at a time, for the time of two copies over the host link per block. The bytes
that come back are the bytes that left, so the gradients do not change.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from fxmem.analysis.graph import storage_bytes
from fxmem.analysis.meta import HOST, VALUE
from fxmem.analysis.saved import stashed_unchecked
from fxmem.passes.manager import GraphPass, PipelineState
from fxmem.passes.saved_rewrite import SavedTensorEditor, call

prims = torch.ops.prims
HOST_DEVICE = torch.device("cpu")


class OffloadBlocks(GraphPass):
    name = "offload_blocks"
    stage = "partitioned"

    def run(self, state: PipelineState) -> str:
        editor = SavedTensorEditor(state)
        storages: dict[str, list[int]] = {}
        for index, (saved, plan) in enumerate(zip(state.analysis.saved, state.plans, strict=True)):
            if plan.host:
                storages.setdefault(saved.storage, []).append(index)
        moved, left = [], []
        for indices in storages.values():
            owner, plan = state.analysis.saved[indices[0]], state.plans[indices[0]]  # the owner carries the plan
            parts = [owner.node] if plan.action == "keep" else state.stored.get(owner.base.name, [])
            parts = [p for p in parts if storage_bytes(p.meta[VALUE])]  # an empty one (no outliers) holds nothing
            unmovable = [p.name for p in parts if p not in editor.placeholder_of or stashed_unchecked(p)
                         or not editor.placeholder_of[p].users or not p.meta[VALUE].is_contiguous()]
            if unmovable or not parts:  # the plan says what stays: the device holds it whole
                left.append(owner.name)
                for i in indices:
                    state.plans[i] = dataclasses.replace(state.plans[i], host=False, reason=(
                        f"{state.plans[i].reason}; left on the device: {', '.join(unmovable) or 'nothing stored'} "
                        "not saved as itself, unread in backward, or not contiguous"))
                continue
            for part in parts:
                _offload(editor, part)
            moved.extend(parts)
        nbytes = sum(storage_bytes(p.meta[VALUE]) for p in moved)
        summary = [f"{len(moved)} stored tensor(s) of {len(storages) - len(left)} block input(s) in host memory "
                   f"between forward and backward ({nbytes / 2**20:.2f} MiB)" if moved else "",
                   f"left on the device: {', '.join(left)} (their plans say why)" if left else ""]
        return "; ".join(p for p in summary if p)


def _offload(editor: SavedTensorEditor, part: Node) -> None:
    """Save a host copy of forward ``part``, made after its last forward reader; backward reads it back on
    ``part``'s device before its first reader."""
    fw_graph, bw_graph = editor.fw.graph, editor.bw.graph
    position = {n: i for i, n in enumerate(fw_graph.nodes)}
    readers = [u for u in part.users if u.op != "output"]
    after = max(readers, key=position.__getitem__) if readers else part
    with fw_graph.inserting_after(after):
        host = call(fw_graph, prims.device_put.default, (part, HOST_DEVICE), kwargs={"non_blocking": True})
    host.meta[HOST] = True
    outputs = list(editor.fw_output.args[0])
    outputs[outputs.index(part, editor.num_fwd_outputs)] = host
    editor.fw_output.args = (tuple(outputs), *editor.fw_output.args[1:])

    placeholder = editor.placeholder_of.pop(part)
    editor.placeholder_of[host] = placeholder
    placeholder.meta[VALUE] = host.meta[VALUE]
    placeholder.meta[HOST] = True
    first_reader = editor.first_backward_use([placeholder])
    with bw_graph.inserting_before(first_reader):
        back = call(bw_graph, prims.device_put.default, (placeholder, part.meta[VALUE].device),
                    kwargs={"non_blocking": True})
    placeholder.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
