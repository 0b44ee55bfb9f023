"""The plan: what happens to each saved tensor. Decided from the config; priced by the cost model."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Literal

from torch.fx import Node

from fxmem.analysis import Analysis, Role, SavedTensor
from fxmem.analysis.graph import memory_order, numel_hint, storage_base, storage_bytes, tensor_val
from fxmem.analysis.rope import rope_recompute
from fxmem.config import Config
from fxmem.cost_model.memory import quantized_bytes, sparse_bytes

Action = Literal["keep", "quantize", "sparsify"]

# Roles HyC-LoRA stores quantized (section 4.1): the inputs of non-linear operators and of linears.
QUANTIZED_ROLES = frozenset({Role.NORM_INPUT, Role.ACT_INPUT, Role.PRODUCT_INPUT, Role.ATTN_QKV,
                             Role.LINEAR_INPUT})
# Kept exact even when the tensor also serves a quantized role: x @ A carries what LoRA learns, and the
# logits' error would reach every gradient through the loss. (Fused attention's output, ATTN_OUT, is not in
# QUANTIZED_ROLES: its backward needs it consistent with q, k, v; see passes/recompute_attention.py.)
EXACT_ROLES = frozenset({Role.LORA_INTERMEDIATE, Role.LOSS_INPUT})


@dataclass(frozen=True)
class Plan:
    action: Action
    reason: str
    bits: int | None = None  # quantize
    channels: int = 0  # quantize: channels with their own scale (the innermost memory dimension)
    outliers: int = 0  # quantize: channels kept in full precision
    keep: int = 0  # sparsify: values kept per row
    source: str | None = None  # the node compressed instead of the saved tensor (x before RoPE)
    nbytes: int | None = None  # bytes after the plan (cost model), None for keep

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, 0) or k in ("action", "reason")}


def plan_region(analysis: Analysis, config: Config) -> list[Plan]:
    """One plan per saved tensor, in the analysis' order.

    Tensors sharing a storage are planned together: the storage is compressed
    only if every tensor viewing it may be.
    """
    by_storage: dict[str, list[SavedTensor]] = {}
    for saved in analysis.saved:
        by_storage.setdefault(saved.storage, []).append(saved)
    plans = []
    tables_saved: set[str] = set()  # RoPE tables already paid for by an earlier plan
    owner_plans: dict[str, Plan] = {}
    for saved in analysis.saved:
        group = by_storage[saved.storage]
        owner = group[0]  # the analysis counts a storage's bytes on its first saved tensor
        if saved is owner:
            plan = owner_plans[saved.storage] = _plan_storage(owner, group, analysis, config, tables_saved)
        elif owner_plans[saved.storage].action != "keep":
            plan = dataclasses.replace(owner_plans[saved.storage], reason=f"view of {owner.name}, compressed with it",
                                       nbytes=None)
        else:
            plan = Plan("keep", f"shares storage with {owner.name}" if saved.frees_memory
                        else "frees nothing: not an activation")
        plans.append(plan)
    return plans


def _plan_storage(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                  tables_saved: set[str]) -> Plan:
    if not owner.frees_memory:
        return Plan("keep", "frees nothing: not an activation")
    if owner.storage in analysis.output_storages:
        return Plan("keep", "also a forward output: the caller holds it anyway")
    if not config.enabled_techniques():
        return Plan("keep", "no technique enabled")
    exact = sorted({r.value for s in group for r in (s.role, *s.also) if r in EXACT_ROLES})
    if exact:
        return Plan("keep", f"kept exact: {', '.join(exact)}")
    if owner.role is Role.ATTN_PROBS and owner.detail == "probabilities" and config.attn_sparsity is not None:
        return _sparsify(owner, analysis, config.attn_sparsity)
    quantizable = all(s.role in QUANTIZED_ROLES for s in group)
    if config.bits is not None and quantizable:
        return _quantize(owner, analysis, config, tables_saved)
    return Plan("keep", f"no enabled technique applies to {owner.role.value}")


def _quantize(owner: SavedTensor, analysis: Analysis, config: Config, tables_saved: set[str]) -> Plan:
    node = storage_base(analysis.nodes[owner.name])
    bits = config.bits
    if owner.role is Role.ATTN_QKV and owner.detail in ("q", "k") and config.qk_bits is not None:
        bits = config.qk_bits
    reason = f"{bits}-bit per channel"
    source = None
    new_tables: list[Node] = []  # RoPE tables this plan saves (as they are) that no earlier plan saves
    if owner.role is Role.ATTN_QKV:
        rope = rope_recompute(node)
        if rope is not None and rope.source.name not in analysis.saved_storages:
            node, source = rope.source, rope.source.name
            reason += f"; x before RoPE ({source}), rotation replayed in backward"
            new_tables = list({t.name: t for t in map(storage_base, rope.tables)
                               if t.name not in analysis.saved_storages | tables_saved}.values())
    val = tensor_val(node)
    if val.dim() < 2 or not val.dtype.is_floating_point or numel_hint(val) == 0:
        return Plan("keep", "not a floating tensor with rows and channels")
    order = memory_order(val)
    if order is None:
        return Plan("keep", "not dense in memory: no channel layout to quantize")
    if not isinstance(val.shape[order[-1]], int):
        return Plan("keep", "symbolic channel dimension: scales need a fixed channel count")
    channels = val.shape[order[-1]]
    outliers = 0
    if owner.role is Role.NORM_INPUT and config.outlier_ratio > 0:
        outliers = min(channels, max(1, round(config.outlier_ratio * channels)))
        reason += f", {outliers} outlier channel{'s' if outliers > 1 else ''} exact"
    nbytes = quantized_bytes(numel_hint(val), channels, bits, outliers, val.element_size()) + sum(
        storage_bytes(tensor_val(t)) for t in new_tables)
    if nbytes >= owner.nbytes:
        return Plan("keep", f"quantizing would not shrink it ({nbytes} >= {owner.nbytes} bytes)")
    tables_saved.update(t.name for t in new_tables)  # only now: a kept tensor saves no table
    return Plan("quantize", reason, bits=bits, channels=channels, outliers=outliers, source=source,
                nbytes=nbytes)


def _sparsify(owner: SavedTensor, analysis: Analysis, ratio: float) -> Plan:
    val = tensor_val(storage_base(analysis.nodes[owner.name]))
    if any(not isinstance(s, int) for s in val.shape) or not val.is_contiguous():
        return Plan("keep", "attention probabilities with a symbolic or strided layout are kept")
    row = val.shape[-1]
    keep = max(1, math.ceil(ratio * row))
    return Plan("sparsify", f"largest {keep} of {row} per row kept", keep=keep,
                nbytes=sparse_bytes(numel_hint(val), row, keep, val.element_size()))
