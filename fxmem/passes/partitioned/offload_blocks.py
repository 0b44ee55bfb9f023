"""Move each checkpointed block's stored input to host memory between forward and backward (block_offload).

The planner marks the plans (cost_model/planner.fit_ceilings, or cost_model/budget.fit_budget under a budget);
this moves what each stores: the saved tensor itself where it is kept exact, or the tensors the quantize or
lowrank pass saved in its place. Forward copies each to host memory after its last forward reader and saves the copy; backward copies it
back to the device before its first reader. Both copies are ``prims.device_put``, as torch's own activation
offloading inserts them (torch/_functorch/_activation_offloading), and run on the compute stream in the graph's
order: the device holds one block's input at a time, for the time of two copies over the host link per block.
The bytes that come back are the bytes that left, so the gradients do not change.

On a GPU inductor copies each tensor into pinned host memory and waits for it: one synchronization per tensor (a
block's 8-bit codes are five), as torch's synchronous offloading does. Overlapping the copies with compute (its
side-stream form) is not done. A plan whose tensors cannot all move (not saved as themselves, unread in backward,
not contiguous, or with fidelity probes on) stays on the device, and its plan says so.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node

from fxmem.analysis.graph import is_view, storage_bytes
from fxmem.analysis.meta import HOST, VALUE
from fxmem.analysis.saved import stashed_unchecked
from fxmem.cost_model.options import on_device
from fxmem.cost_model.plan import Action
from fxmem.fallback import fall_back
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, pass_result
from fxmem.passes.saved_rewrite import SavedTensorEditor, call

aten = torch.ops.aten
prims = torch.ops.prims
HOST_DEVICE = torch.device("cpu")


class OffloadBlocks(GraphPass):
    name = "offload_blocks"
    stage = "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        editor = SavedTensorEditor(state)
        storages: dict[str, list[int]] = {}
        for index, (saved, plan) in enumerate(zip(state.analysis.saved, state.plans, strict=True)):
            if plan.host:
                storages.setdefault(saved.storage, []).append(index)
        moved, left = [], []
        # forward's order, taken once: the nodes _offload inserts read only their own part, never another's
        position = {n: i for i, n in enumerate(editor.fw.graph.nodes)}
        for indices in storages.values():
            owner, plan = state.analysis.saved[indices[0]], state.plans[indices[0]]  # the owner carries the plan
            parts = [owner.node] if plan.action is Action.KEEP else state.stored.get(owner.base.name, [])
            parts = [p for p in parts if storage_bytes(p.meta[VALUE])]  # an empty one (no outliers) holds nothing
            why = _unmovable(state, editor, parts)
            if why is not None:  # the plan says what stays: the device holds it whole
                left.append(owner.name)
                for i in indices:
                    state.plans[i] = on_device(state.plans[i], owner, why) if i == indices[0] else \
                        dataclasses.replace(state.plans[i], host=False)
                continue
            for part in parts:
                _offload(editor, part, position)
            moved.extend(parts)
        if left:  # strict mode raises, as for any planned rewrite left undone
            fall_back(f"planned offload to host memory left undone, kept on the device: {', '.join(left)}",
                      state.config, stacklevel=3)
        nbytes = sum(storage_bytes(p.meta[VALUE]) for p in moved)
        summary = [f"{len(moved)} stored tensor(s) of {len(storages) - len(left)} block input(s) in host memory "
                   f"between forward and backward ({nbytes / 2**20:.2f} MiB)" if moved else "",
                   f"left on the device: {', '.join(left)} (their plans say why)" if left else ""]
        return pass_result(bool(moved), *summary)


def _unmovable(state: PipelineState, editor: SavedTensorEditor, parts: list[Node]) -> str | None:
    """Why a storage stored as ``parts`` stays on the device, or None where every part can move."""
    if state.probes is not None:
        return "fidelity probes save its exact value beside"
    if not parts:
        return "nothing stored as planned"
    unmovable = [p.name for p in parts if p not in editor.placeholder_of or stashed_unchecked(p)
                 or not editor.placeholder_of[p].users or not p.meta[VALUE].is_contiguous()]
    if unmovable:
        return f"{', '.join(unmovable)} not saved as itself, unread in backward, or not contiguous"
    return None


def _offload(editor: SavedTensorEditor, part: Node, position: dict[Node, int]) -> None:
    """Save a host copy of forward ``part``, made after its last forward reader (``position``: forward's order);
    backward reads it back on ``part``'s device before its first reader."""
    fw_graph, bw_graph = editor.fw.graph, editor.bw.graph
    readers = [u for u in part.users if u.op != "output"]
    after = max(readers, key=position.__getitem__) if readers else part
    with fw_graph.inserting_before(after.next):  # in order: inserting_after would place each before the last
        source = part
        if part.target is operator.getitem or is_view(part):
            # torch's own offloading moves neither an item of a multi-output op nor a view: a tensor of its own
            source = call(fw_graph, aten.clone.default, (part,))
        host = call(fw_graph, prims.device_put.default, (source, HOST_DEVICE), kwargs={"non_blocking": True})
    host.meta[HOST] = True
    placeholder = editor.replace_saved(part, host)
    placeholder.meta[HOST] = True
    first_reader = editor.first_backward_use([placeholder])
    with bw_graph.inserting_before(first_reader):
        back = call(bw_graph, prims.device_put.default, (placeholder, part.meta[VALUE].device),
                    kwargs={"non_blocking": True})
    placeholder.replace_all_uses_with(back, delete_user_cb=lambda user: user is not back)
