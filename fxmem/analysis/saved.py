"""Find every tensor a partitioned forward keeps for backward, and describe it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, GraphModule, Node

from fxmem.analysis.blocks import Block
from fxmem.analysis.graph import (
    layer_of,
    module_path,
    original_op,
    shape_hint,
    shape_text,
    storage_base,
    storage_bytes,
    tensor_val,
    users_through_views,
)
from fxmem.analysis.lora import LoraLinear, find_lora_linears
from fxmem.analysis.meta import BLOCK_SOURCE, LORA_REORDERED
from fxmem.analysis.norm import NormUnit, norm_unit
from fxmem.analysis.recompute import pointwise_rebuild, product_rebuild
from fxmem.analysis.roles import (
    FREES_NOTHING,
    Role,
    TensorFacts,
    chunked_rebuild_reader,
    classify,
    projected_into_attention,
    reaches_attention,
)
from fxmem.analysis.rope import Replay, attention_input_replay

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)  # the values of a graph's symbolic (non-tensor) nodes

# The graph facts of a record, for the planner and the passes: references into the forward graph, left out of
# the report's dict and of the record a compiled region keeps.
_GRAPH = {"graph": True}


@dataclass(frozen=True)
class SavedRecord:
    """One tensor held from forward to backward, as the report shows it: names and figures, no graph references
    (what a compiled region keeps, fxmem/region.py)."""

    index: int  # position among the saved tensors (the backward's placeholder order)
    name: str  # forward graph node
    role: Role
    detail: str
    also: tuple[Role, ...]  # other roles the tensor matches (it is saved once, for all of them)
    producer: str  # aten op (before decomposition) that computed its storage
    backward_consumers: tuple[str, ...]
    module: str  # module path that produced it
    layer: str  # repeated block it belongs to, '' outside blocks
    shape: tuple[int, ...]  # sizes at the compile-time example (hints for dynamic sizes)
    shape_text: str  # sizes as traced, symbolic where dynamic
    dtype: str
    nbytes: int  # bytes this record accounts for: 0 when it frees nothing or shares a storage
    storage: str  # node that allocated its storage
    shares_storage_with: str | None
    rebuilt_for: str | None = None  # lora_reorder's consumer ('silu', 'q', ...) when backward rebuilds from it
    feeds_attention: str | None = None  # 'q', 'k' or 'v': attention's input, saved as it is or rebuilt from it
    # 'q', 'k' or 'v' for a tensor that becomes attention's input through a norm and RoPE (a q/k norm's input) or
    # through a LoRA projection (the q/k/v projections' input); held at qkv_bits as q, k and v are, while attention
    # itself reads something else
    reaches_attention: str | None = None

    @property
    def frees_memory(self) -> bool:
        return self.role not in FREES_NOTHING

    @property
    def key(self) -> str:
        """Names this tensor across compilations of one model at other lengths (the guard's demotions): its module,
        role and forward node; the node's name is the same where the traced ops are."""
        return f"{self.module}:{self.role.value}:{self.name}"

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("graph")}
        data["role"] = self.role.value
        data["also"] = [r.value for r in self.also]
        return data


@dataclass(frozen=True, kw_only=True)
class SavedTensor(SavedRecord):
    """A saved tensor with its graph facts, while its region is partitioned and planned."""

    node: Node = field(metadata=_GRAPH)  # the saved forward node
    base: Node = field(metadata=_GRAPH)  # the node that allocated its storage
    # what the q, k or v is rebuilt from (x before RoPE, the tensor before GQA's repeat), for attention inputs
    replay: Replay | None = field(default=None, metadata=_GRAPH)
    norm: NormUnit | None = field(default=None, metadata=_GRAPH)  # the norm whose backward saves it (norm inputs)
    # the element-wise ops (and the experts' grouped products) that rebuild its storage from other saved storages
    # and graph inputs, if there are any
    recompute: tuple[Node, ...] | None = field(default=None, metadata=_GRAPH)
    # an X W lora_reorder rebuilds from: the matmul (and the views it reads) that rebuilds it from the saved x
    rebuild_product: tuple[Node, ...] | None = field(default=None, metadata=_GRAPH)
    # the chunked op backward runs again from this storage (ops.CHUNKED_MLP or ops.CHUNKED_NORM), if one does
    chunked_reader: str | None = None

    def record(self) -> SavedRecord:
        """The report's record, without the graph references that would keep the graphs (and their fake tensors)
        alive as long as the report."""
        return SavedRecord(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SavedRecord)})


@dataclass
class Analysis:
    """The saved tensors of one partitioned region plus the graph facts passes need."""

    saved: list[SavedTensor]
    loras: list[LoraLinear]
    output_storages: frozenset[str] = frozenset()  # storages of the forward's user outputs (the caller holds them)
    exact_bytes: int | None = None  # what torch.compile's own partition of the region saves, where it was measured
    # storages backward rebuilds a recomputed X W from (the planner's first partition chose it, or the chunked
    # MLP's input): quantized at no fewer than cost_model.planner.REBUILD_SOURCE_BITS
    rebuild_sources: frozenset[str] = frozenset()
    # the repeated blocks memory_budget may checkpoint (block_checkpoint), found in the joint graph this partition
    # came from; empty where they are checkpointed already or not on offer
    blocks: tuple[Block, ...] = ()

    @property
    def saved_storages(self) -> frozenset[str]:
        return frozenset(s.storage for s in self.saved)


def saved_tensor_nodes(fw: GraphModule, num_fwd_outputs: int) -> list[Node]:
    """The forward's outputs that backward receives as tensors (SymInts and opaque objects left out)."""
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    return [n for n in outputs[num_fwd_outputs:] if isinstance(n, Node) and tensor_val(n) is not None]


def stashed_unchecked(node: Node) -> bool:
    """A saved tensor AOTAutograd stashes on its context unchecked for versions (not ``save_for_backward``): it
    counts those from the end of the saved tensors, and holds them there to the end of backward."""
    return node.meta.get("saved_tensor_with_no_vc_check", False)


def saved_placeholders(fw: Graph, bw: Graph, num_fwd_outputs: int) -> dict[Node, Node]:
    """Each tensor forward saves, with the backward placeholder that receives it. AOTAutograd's contract: the forward
    returns user outputs, saved tensors, opaque objects, SymInts; the backward takes SymInts, saved tensors, opaque
    objects, tangents. So they pair by position (names do not: a pass that saves a new tensor names it anew)."""
    saved = fw.find_nodes(op="output")[0].args[0][num_fwd_outputs:]
    tensors = [n for n in saved if isinstance(n, Node) and tensor_val(n) is not None]
    symbols = sum(1 for n in saved if isinstance(n, Node) and isinstance(n.meta.get("val"), SYMBOLIC))
    placeholders = list(bw.find_nodes(op="placeholder"))[symbols:symbols + len(tensors)]
    if [p.meta.get("val") is not None and tensor_val(p) is not None for p in placeholders] != [True] * len(tensors):
        raise RuntimeError("backward placeholders do not line up with the forward's saved tensors")
    return dict(zip(tensors, placeholders, strict=True))


def analyze(fw: GraphModule, bw: GraphModule, num_fwd_outputs: int,
            static_input_indices: Sequence[int] | None) -> Analysis:
    """Classify every saved tensor of a partitioned region.

    ``static_input_indices`` are the forward inputs with static lifetime
    (parameters and buffers, as AOTAutograd reports them); other inputs are
    user inputs. Either kind frees nothing when compressed.
    """
    placeholders = list(fw.graph.find_nodes(op="placeholder"))
    params = frozenset(placeholders[i] for i in (static_input_indices or ()) if i < len(placeholders))
    inputs = frozenset(placeholders) - params
    loras = find_lora_linears(fw.graph, params)
    lora_by_xa = {lora.xa: lora for lora in loras}
    bw_placeholders = {p.name: p for p in bw.graph.find_nodes(op="placeholder")}
    fw_nodes = {n.name: n for n in fw.graph.nodes}

    saved_nodes = saved_tensor_nodes(fw, num_fwd_outputs)
    saved_bases = frozenset(map(storage_base, saved_nodes))
    records: list[SavedTensor] = []
    first_by_storage: dict[Node, str] = {}
    for index, node in enumerate(saved_nodes):
        base = storage_base(node)
        bw_node = bw_placeholders.get(node.name)
        bw_users = users_through_views(bw_node) if bw_node is not None else []
        facts = TensorFacts(node=node, base=base, fw_users=users_through_views(base), bw_users=bw_users,
                            params=params, inputs=inputs, lora_by_xa=lora_by_xa, fw_nodes=fw_nodes,
                            saved_bases=saved_bases)
        roles = classify(facts)
        role, detail = roles[0]
        val = tensor_val(node)
        module = module_path(base)
        frees = role not in FREES_NOTHING
        shared_with = first_by_storage.get(base) if frees else None
        if frees and shared_with is None:
            first_by_storage[base] = node.name
        nbytes = storage_bytes(tensor_val(base)) if frees and shared_with is None else 0
        rebuilt_for = base.meta.get(LORA_REORDERED)
        records.append(SavedTensor(
            index=index, name=node.name, role=role, detail=detail,
            also=tuple(dict.fromkeys(r for r, _ in roles[1:] if r is not role)),
            producer=original_op(base) if base.op == "call_function" else base.op,
            backward_consumers=tuple(dict.fromkeys(original_op(u) for u in bw_users)),
            module=module, layer=layer_of(module),
            shape=shape_hint(val), shape_text=shape_text(val), dtype=str(val.dtype).removeprefix("torch."),
            nbytes=nbytes, storage=base.name, shares_storage_with=shared_with, node=node, base=base,
            replay=attention_input_replay(base) if role is Role.ATTN_QKV else None,
            norm=norm_unit(base) if role is Role.NORM_INPUT else None, rebuilt_for=rebuilt_for,
            chunked_reader=chunked_rebuild_reader(base),
            recompute=pointwise_rebuild(base, saved_bases) if frees else None,
            rebuild_product=product_rebuild(base, saved_bases) if frees and role is Role.LORA_BASE_OUTPUT else None,
            feeds_attention=_attention_operand(role, detail, rebuilt_for),
            reaches_attention=(reaches_attention(base) if role is Role.NORM_INPUT else projected_into_attention(
                base, loras) if Role.LINEAR_INPUT in (role, *(r for r, _ in roles[1:])) else None)))
    outputs = fw.graph.find_nodes(op="output")[0].args[0][:num_fwd_outputs]
    output_storages = frozenset(storage_base(n).name for n in outputs if isinstance(n, Node))
    # the chunked MLP's backward replays its gate and up products from its input, the chunked norm is recomputed
    # from its input, and a checkpointed block from its output, as a rebuilt X W is from its x
    sources = frozenset(r.storage for r in records if BLOCK_SOURCE in r.base.meta or r.chunked_reader is not None)
    return Analysis(saved=records, loras=loras, output_storages=output_storages, rebuild_sources=sources)


def _attention_operand(role: Role, detail: str, rebuilt_for: str | None) -> str | None:
    """'q', 'k' or 'v' for attention's input: saved as it is, or the X W lora_reorder rebuilds it from."""
    if role is Role.ATTN_QKV and detail in ("q", "k", "v"):
        return detail
    if role is Role.LORA_BASE_OUTPUT and rebuilt_for in ("q", "k", "v"):
        return rebuilt_for
    return None

