"""What a region holds that no plan can free, by cause: a KV cache the forward returns (a model built with
``use_cache=True``), saved inputs the caller keeps, and the forward ops activation
checkpointing (``torch.utils.checkpoint``, HF's ``gradient_checkpointing_enable``) reruns in backward. Facts for
the report: nothing here rewrites."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import storage_base, storage_bytes, tensor_val, users_through_views
from fxmem.analysis.roles import Role, eager_attention_operand, forward_attention_operands
from fxmem.analysis.saved import Analysis

# torch's activation checkpointing marks every joint-graph node of a checkpointed region with its region's id
AC_GRAPH_ID = "ac_graph_id"
# Between a cached k or v and attention: grouped-query attention's repeat (expand, then a copy)
_COPIES = frozenset({torch.ops.aten.clone.default, torch.ops.aten._unsafe_view.default})


@dataclass(frozen=True)
class Pinned:
    kv_cache_bytes: int  # k and v the forward returns: a KV cache
    input_bytes: int  # saved floating-point user inputs and views of them (not parameters, buffers, ids or masks)
    checkpointed_ops: int  # forward ops inside activation-checkpointed regions: backward reruns them
    checkpoint_regions: int


def pinned(analysis: Analysis, fw: Graph, num_fwd_outputs: int, joint: Graph) -> Pinned:
    """``analysis`` of the partition of ``joint`` whose forward is ``fw``."""
    outputs = fw.find_nodes(op="output")[0].args[0][:num_fwd_outputs]
    kv = {storage_base(n) for n in outputs if isinstance(n, Node) and tensor_val(n) is not None}
    kv = {base for base in kv if _attention_key_or_value(base)}
    inputs = {s.base: storage_bytes(val) for s in analysis.saved
              if s.role is Role.INPUT_VIEW and (val := tensor_val(s.base)).is_floating_point()}
    checkpointed = [n for n in joint.nodes if n.op == "call_function" and AC_GRAPH_ID in n.meta]
    return Pinned(kv_cache_bytes=sum(storage_bytes(tensor_val(base)) for base in kv),
                  input_bytes=sum(inputs.values()), checkpointed_ops=len(checkpointed),
                  checkpoint_regions=len({n.meta[AC_GRAPH_ID] for n in checkpointed}))


def _attention_key_or_value(base: Node) -> bool:
    """The storage ``base`` is attention's k or v in forward: through views, or copied per head (GQA's repeat)."""
    for user in users_through_views(base):
        if user.target in _COPIES:
            if _attention_key_or_value(user):
                return True
        elif any(isinstance(arg, Node) and storage_base(arg) is base for arg in forward_attention_operands(user)[1:3]):
            return True
        elif eager_attention_operand(user, base) in ("k", "v"):
            return True
    return False
