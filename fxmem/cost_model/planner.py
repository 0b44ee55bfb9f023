"""The planner: what happens to each saved tensor of a region, decided from the config, priced by the cost model."""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.analysis import Analysis, Role, SavedTensor
from fxmem.analysis.blocks import Block
from fxmem.analysis.graph import (
    hint,
    memory_order,
    merged_channels,
    numel_hint,
    storage_base,
    storage_bytes,
    tensor_val,
)
from fxmem.analysis.lora import matmul_operands
from fxmem.analysis.meta import BLOCK_SOURCE
from fxmem.analysis.norm import NormUnit
from fxmem.analysis.recompute import copies_values, rebuild_inputs, replays_product
from fxmem.analysis.rope import Replay
from fxmem.config import BITS_CHOICES, Config
from fxmem.cost_model.memory import (
    lowrank_bytes,
    planned_bytes,
    prenorm_bytes,
    quantized_bytes,
    sparse_bytes,
    stored_bytes,
)
from fxmem.cost_model.plan import Plan
from fxmem.cost_model.prices import (
    forward_seconds,
    lowrank_seconds,
    offload_seconds,
    product_seconds,
    quantize_seconds,
    recompute_seconds,
)
from fxmem.kernels.lowrank import DEFAULT_NITER, resolve_rank
from fxmem.kernels.quantize import MIN_ROTATION_BLOCK, fits_range, outlier_chunk, rotation_block

# Roles HyC-LoRA stores quantized (section 4.1): the inputs of non-linear operators and of linears.
QUANTIZED_ROLES = frozenset({Role.NORM_INPUT, Role.ACT_INPUT, Role.PRODUCT_INPUT, Role.ROW_SCALED, Role.ATTN_QKV,
                             Role.LINEAR_INPUT, Role.LORA_BASE_OUTPUT})
# Kept exact even when the tensor also serves a quantized role: x @ A carries what LoRA learns, the logits'
# error would reach every gradient through the loss, and the chunked loss's gradients are gradients. (Fused attention's output, ATTN_OUT, is not in
# QUANTIZED_ROLES: its backward needs it consistent with q, k, v; see passes/recompute_attention.py.)
EXACT_ROLES = frozenset({Role.LORA_INTERMEDIATE, Role.LOSS_INPUT, Role.LOSS_GRADIENT, Role.ROUTER})
# Roles LoRAct stores as low-rank factors: their backward needs only the value. Attention's q, k, v too: fused
# attention is then recomputed in backward from the rebuilt values (passes/recompute_attention.py), q and k
# factored before RoPE, as (rows, hidden) matrices. Scores, probabilities and eager attention's output are left to
# other techniques.
LOWRANK_ROLES = frozenset({Role.NORM_INPUT, Role.ACT_INPUT, Role.PRODUCT_INPUT, Role.LINEAR_INPUT, Role.ATTN_QKV})
# Pre-norm sharing saves the input channels with the smallest |gamma| exactly: output / gamma carries nothing
# where gamma == 0 and amplifies the factors' error where |gamma| is small. One channel in 256, at least one.
PRENORM_EXACT_SHARE = 1 / 256
# Outlier values (Config.outlier_values) at this width and below. At 4 bits the clamp they come with cost more
# than they kept: clamped, the worst gradient fell; on the channel's whole range they changed nothing (measured:
# docs/quantization.md).
OUTLIER_VALUE_BITS = 2
# LoRA outputs feeding these are not rebuilt below 8 bits. Without the rebuild torch saves the activation's
# derivative (and output), which are bounded; rounding the wide-ranged input instead and replaying the
# activation doubles the derivative's error (measured: docs/quantization.md). ReLU's derivative is its saved
# output's sign: rebuilt from X W, every value rounded across zero flips it, and the worst LoRA gradient fell below
# the one with its output saved (measured: docs/quantization.md). SiLU is rebuilt: there torch saves the input, the
# same value the rebuild rounds.
DERIVATIVE_SAVED_ACTIVATIONS = frozenset({"gelu", "tanh", "relu"})
REBUILD_ALL_ACTIVATIONS_BITS = 8
# x in x * s (one s per row: an expert's output and its routing weight) is read only for s's gradient, a sum over
# the row, which the router's gradient follows from: stored at no fewer bits than these (docs/analysis.md has the
# cosines at 4 and 8); where rebuild_from_x replays the experts' products from their 8-bit input, that rebuild is
# exact-tier and wins over these codes
ROW_SCALED_BITS = 4
# Backward ops that read which saved values are positive: ReLU's backward passes the gradient where its saved output
# is, so a small positive value rounded to zero drops its gradient; kept positive, the mask is exact (measured with
# fxmem bench coverage: docs/quantization.md).
POSITIVE_MASK_BACKWARDS = frozenset({"threshold_backward"})
# An X W that backward rebuilds by replaying its matmul (Config.rebuild_from_x) reads its x, which is then
# stored at no fewer bits than this: x left at 4 bits carried its error into both the replayed X W and LoRA A's
# gradient, a worse gradient than X W stored at 4 bits, where x at 8 holds the preset's bound (measured with
# fxmem bench ablate: docs/quantization.md).
REBUILD_SOURCE_BITS = 8
# memory_budget's ladder: (bits, sensitivity) stages, taken in order until the region fits. Sensitivity 0 is
# activation and product inputs and X W; 1 norm inputs; 2 linear inputs; 3 attention's q, k, v. The least
# sensitive go first, and q, k, v drop below 8 bits last, after everything else is at 2 (docs/quantization.md
# measures why: the softmax amplifies their error; a linear input's error reaches its LoRA A's gradient whole, and
# at 2 bits it was worse than a norm input's).
BUDGET_STAGES = ((8, 0), (8, 1), (8, 2), (8, 3), (4, 0), (4, 1), (4, 2), (2, 0), (2, 1), (2, 2), (4, 3), (2, 3))


def rebuild_refusal(consumer: str, config: Config) -> str | None:
    """Why lora_reorder should leave a LoRA output feeding ``consumer`` as is, or None to rebuild it.
    ``config`` has ``bits`` (Config refuses lora_reorder without them). With ``rebuild_from_x`` (not counted on
    under memory_budget, whose plan replays an X W only where that is its cheapest move) the X W is replayed from x
    at REBUILD_SOURCE_BITS, or else stored at that width (_configured_bits): never rounded coarser."""
    if consumer in DERIVATIVE_SAVED_ACTIVATIONS and config.bits < REBUILD_ALL_ACTIVATIONS_BITS \
            and not (config.rebuild_from_x and config.memory_budget is None):
        return (f"feeding {consumer} left as is: at {config.bits} bits the saved {consumer} derivative is more "
                "faithful than a rebuilt input")
    return None


# A technique's planner hook (fxmem.techniques registers it): ``propose`` the compression the config asks of one
# storage (None where the technique does not apply; it may add the RoPE tables the plan pays for to the set it is
# given). The choice among them and every other option is the planner's (fit_ceilings, fit_budget).
Propose = Callable[[SavedTensor, list[SavedTensor], Analysis, Config, set[str]], Plan | None]


class TechniqueHooks(Protocol):
    name: str
    propose: Propose | None


def plan_region(analysis: Analysis, config: Config, techniques: Sequence[TechniqueHooks],
                demoted: Mapping[str, int] | None = None) -> list[Plan]:
    """One plan per saved tensor, in the analysis' order: with memory_budget its one rule down to the region's target
    (fit_budget), else the same kind of choice against each storage's ceiling, the compression the config asks of it
    (fit_ceilings).

    Tensors sharing a storage are planned together: the storage is compressed
    only if every tensor viewing it may be.

    ``demoted``: the guard's demotions (fxmem/guard.py), a saved tensor's key (SavedRecord.key) -> how many steps:
    its storage's configured compression is made that many steps less lossy (_demoted_plan); under memory_budget
    a demoted storage is kept exact.
    """
    by_storage: dict[str, list[SavedTensor]] = {}
    for saved in analysis.saved:
        by_storage.setdefault(saved.storage, []).append(saved)
    levels = {storage: max(demoted.get(s.key, 0) for s in group)
              for storage, group in by_storage.items()} if demoted else {}
    tables_saved: set[str] = set()  # RoPE tables already paid for by an earlier plan
    # the analysis counts a storage's bytes on its first saved tensor, its owner
    held = {storage: _held_as_is(group[0], group, analysis) for storage, group in by_storage.items()}
    if config.memory_budget is not None:  # the budget's planner starts from the fastest plan and spends from there
        owner_plans = {storage: plan or (Plan("keep", "exact: demoted by the guard") if levels.get(storage)
                                         else Plan("keep", "exact: memory_budget needs no bytes of it"))
                       for storage, plan in held.items()}
        fit_budget(analysis, by_storage, owner_plans, config, tables_saved,
                   frozen={storage for storage, level in levels.items() if level})
    else:
        owner_plans = fit_ceilings(analysis, by_storage, held, config, tables_saved, techniques, levels)
    plans = []
    for saved in analysis.saved:
        owner, owner_plan = by_storage[saved.storage][0], owner_plans[saved.storage]
        if saved is owner:
            plan = owner_plan
        elif owner_plan.action != "keep":
            plan = dataclasses.replace(owner_plan, reason=f"view of {owner.name}, compressed with it", nbytes=None)
        else:
            plan = Plan("keep", f"shares storage with {owner.name}" if saved.frees_memory
                        else "frees nothing: not an activation")
        plans.append(plan)
    return plans


def _held_as_is(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis) -> Plan | None:
    """The plan of a storage no technique may compress, or None."""
    if not owner.frees_memory:
        return Plan("keep", "frees nothing: not an activation")
    if owner.storage in analysis.output_storages:
        if any(s.feeds_attention in ("k", "v") for s in group):
            return Plan("keep", "also a forward output, the caller holds it anyway: a KV cache (use_cache=False "
                                "in training frees it)")
        return Plan("keep", "also a forward output: the caller holds it anyway")
    exact = sorted({r.value for s in group for r in (s.role, *s.also) if r in EXACT_ROLES})
    if exact:
        return Plan("keep", f"kept exact: {', '.join(exact)}")
    return None


def _configured_plan(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                     tables_saved: set[str], techniques: Sequence[TechniqueHooks]) -> Plan:
    """The compression the config asks of a storage: of the enabled techniques' proposals, the fewest bytes (a tie
    goes to the technique registered first: quantization, the cheaper one to compute); keep where none compresses."""
    # each with the RoPE tables it would save, on top of tables_saved (only the chosen plan's count)
    proposals: list[tuple[Plan, set[str]]] = []
    for technique in techniques:
        tables = set(tables_saved)
        plan = technique.propose(owner, group, analysis, config, tables) if technique.propose else None
        if plan is not None:
            proposals.append((plan, tables))
    if not proposals:
        return Plan("keep", f"no enabled technique applies to {owner.role.value}")
    compressing = [c for c in proposals if c[0].action != "keep"]
    if not compressing:
        return Plan("keep", "; ".join(plan.reason for plan, _ in proposals))
    plan, tables = min(compressing, key=lambda c: c[0].nbytes)
    tables_saved.update(tables)
    return plan


def _demoted_plan(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                  tables_saved: set[str], techniques: Sequence[TechniqueHooks], steps: int) -> Plan:
    """The configured compression made ``steps`` steps less lossy (the guard's demotion): each step the config's lossy
    widths are raised a notch (less_lossy) until this storage's plan stores more bytes: more bits, then exact. The
    options fit_ceilings weighs against it (a replay, a recomputation) follow from its bytes."""
    plan = _configured_plan(owner, group, analysis, config, set(tables_saved) if steps else tables_saved, techniques)
    if not steps:
        return plan
    demoted: Config | None = config
    for _ in range(steps):
        while plan.action != "keep":
            demoted = less_lossy(demoted) if demoted is not None else None
            if demoted is None:
                return Plan("keep", f"exact: demoted by the guard ({steps} step{'s' if steps > 1 else ''})")
            candidate = _configured_plan(owner, group, analysis, demoted, set(tables_saved), techniques)
            if candidate.action != "lowrank" and demoted.lowrank is not None:  # factors no longer its plan: an
                demoted = demoted.replace(lowrank=None, prenorm_sharing=True)  # integer rank would double forever
            if stored_bytes(owner, candidate) > stored_bytes(owner, plan):
                plan = candidate
                break
    if plan.action == "keep":
        return Plan("keep", f"exact: demoted by the guard ({steps} step{'s' if steps > 1 else ''})")
    plan = _configured_plan(owner, group, analysis, demoted, tables_saved, techniques)  # its RoPE tables paid
    return dataclasses.replace(plan, reason=f"{plan.reason}; demoted by the guard ({steps} step"
                                            f"{'s' if steps > 1 else ''})")


def less_lossy(config: Config) -> Config | None:
    """One notch less lossy: with ``bits``, each set width of it, ``qkv_bits`` and ``linear_input_bits`` one choice
    up, 8 bits left as it is; ``lowrank``'s rank doubled, off from half the channels; ``attn_sparsity`` doubled, off from a half.
    None where nothing is left to raise: exact."""
    changes: dict[str, object] = {}
    for name in ("bits", "qkv_bits", "linear_input_bits") if config.bits is not None else ():
        bits = getattr(config, name)
        if bits is not None and bits < BITS_CHOICES[-1]:
            changes[name] = BITS_CHOICES[BITS_CHOICES.index(bits) + 1]
    if config.lowrank is not None:
        doubled = config.lowrank * 2
        changes["lowrank"] = None if isinstance(config.lowrank, float) and doubled >= 0.5 else doubled
    if config.attn_sparsity is not None:
        changes["attn_sparsity"] = None if config.attn_sparsity * 2 >= 0.5 else config.attn_sparsity * 2
    if not changes:
        return None
    if "lowrank" in changes and changes["lowrank"] is None:
        changes["prenorm_sharing"] = True  # a part of lowrank, refused without it
    return config.replace(**changes)


def propose_quantized(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                      tables: set[str]) -> Plan | None:
    """``bits``: HyC-LoRA's per-channel quantization, for the roles it stores quantized."""
    if config.bits is None or not all(s.role in QUANTIZED_ROLES for s in group):  # None: demoted off (less_lossy)
        return None
    if not _quantizable(group, config):  # intra=False: the paper's inter-only ablation row
        return Plan("keep", "intra-operator quantization off (intra=False)")
    bits = _configured_bits(owner, config)
    if owner.storage in analysis.rebuild_sources and bits < REBUILD_SOURCE_BITS:
        return _rebuild_source(owner, group, analysis, config, tables, _rebuilt_from(owner))
    return _quantize(owner, group, analysis, config, tables, bits)


def _rebuilt_from(owner: SavedTensor) -> str:
    """What backward rebuilds from a rebuild source (analysis/saved.py says which storages are)."""
    if BLOCK_SOURCE in owner.base.meta:
        return f"block {owner.base.meta[BLOCK_SOURCE]}"
    if owner.detail.startswith("chunked MLP"):
        return "the chunked MLP's gate and up products"
    return "the chunked RMSNorm's output" if owner.detail == "chunked_rms_norm" else "an X W"


def propose_lowrank(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                    tables: set[str]) -> Plan | None:
    """``lowrank``: LoRAct's low-rank factors, for the roles whose backward needs only the value."""
    if config.lowrank is None:  # demoted off (less_lossy)
        return None
    if not all(s.role in LOWRANK_ROLES for s in group) or owner.storage in analysis.rebuild_sources:
        return None  # an x that an X W is replayed from stays quantized at REBUILD_SOURCE_BITS
    # q, k and v quantized at qkv_bits are protected from the softmax's amplification of their error: not factored
    if (config.bits is not None and config.qkv_bits is not None and _quantizable(group, config)
            and any(map(_attention_input, group))):
        return None
    return _lowrank(owner, analysis, config.lowrank, tables)


def propose_sparse(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                   tables: set[str]) -> Plan | None:
    """``attn_sparsity``: eager attention's probabilities pruned per row."""
    if config.attn_sparsity is not None and owner.role is Role.ATTN_PROBS and owner.detail == "probabilities":
        return _sparsify(owner, config.attn_sparsity)
    return None


def _recompute_plan(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]],
                    owner_plans: dict[str, Plan]) -> Plan | None:
    """Recomputing ``owner``'s storage in backward from the saved storages and graph inputs its chain reads, if it is
    compressible (the callers keep what it reads saved); priced by reading them once more as they are planned, or,
    where it replays the experts' products, by running its chain again (their flops)."""
    if owner.recompute is None or not _compressible(by_storage[owner.storage]):
        return None
    leaves = [n.name for n in rebuild_inputs(owner.recompute) if n.name in by_storage]
    device = str(tensor_val(owner.base).device)
    if replays_product(owner.recompute):  # the experts' products run again: their flops
        return Plan("recompute", f"rebuilt in backward by the experts' products from {', '.join(leaves)}",
                    nbytes=0, seconds=forward_seconds(owner.recompute, device), chain=owner.recompute)
    read = sum(stored_bytes(by_storage[leaf][0], owner_plans[leaf]) for leaf in leaves)
    return Plan("recompute", f"rebuilt element-wise in backward from {', '.join(leaves) or 'graph inputs'}",
                nbytes=0, seconds=recompute_seconds(read, device), chain=owner.recompute)


def _compressible(group: list[SavedTensor]) -> bool:
    return all(s.role in QUANTIZED_ROLES | LOWRANK_ROLES for s in group)


def _quantizable(group: list[SavedTensor], config: Config) -> bool:
    """Every tensor of the storage has a role quantization may store; intra=False allows only what lora_reorder
    saves (x W), the paper's inter-only ablation row."""
    return all(s.role in QUANTIZED_ROLES for s in group) and (
        config.intra or all(s.role is Role.LORA_BASE_OUTPUT for s in group))


def _configured_bits(owner: SavedTensor, config: Config) -> int:
    if _lowest_bits(owner) > config.bits:
        return _lowest_bits(owner)  # rebuild_refusal's width, unless replayed from x
    if config.qkv_bits is not None and (owner.feeds_attention or owner.reaches_attention) is not None:
        return config.qkv_bits
    if config.linear_input_bits is not None and Role.LINEAR_INPUT in (owner.role, *owner.also):
        return max(config.bits, config.linear_input_bits)
    return config.bits


def _quantize(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
              tables_saved: set[str], bits: int) -> Plan:
    node, replay, tables_bytes, replay_reason = _replay_source(owner, analysis, tables_saved)
    reason = f"{bits}-bit per channel{replay_reason}"
    val = tensor_val(node)
    refused = _refused_layout(val, "channels", "channel layout to quantize")
    if refused is not None:
        return refused
    order = memory_order(val)
    if not isinstance(val.shape[order[-1]], int):
        return Plan("keep", "symbolic channel dimension: scales need a fixed channel count")
    # The channels of the view backward reads where its storage splits them (heads x head dim): scales per
    # channel of the view, not shared across heads.
    view = tensor_val(owner.node)
    merged = (merged_channels(val, order, view.shape[-1])
              if replay is None and view.dim() > 0 and statically_known_true(view.stride(-1) == 1) else 1)
    channels = math.prod(val.shape[d] for d in order[-merged:])
    if merged > 1:
        reason += f", a scale per channel of the {channels}-wide view backward reads"
    outliers = 0
    if owner.role is Role.NORM_INPUT and config.outlier_ratio > 0:
        outliers = min(channels, max(1, round(config.outlier_ratio * channels)))
        reason += f", {outliers} outlier channel{'s' if outliers > 1 else ''} exact"
    # The fused LoRA epilogue kernels (Config.fused_epilogue) read a rebuilt X W's codes alone: its outlier values
    # would be lost there. Without them X W could keep outlier values; not measured yet, so the presets' bytes stay.
    chunk = (outlier_chunk(config.outlier_values)
             if bits <= OUTLIER_VALUE_BITS and owner.role is not Role.LORA_BASE_OUTPUT else 0)
    if chunk:
        reason += f", one value in {chunk} of each row exact"
    if fits_range(bits):
        reason += ", range fitted per channel"
    rotation = rotation_block(channels, config.rotation) if config.rotation else 0
    if rotation:
        reason += f", rows rotated in Hadamard blocks of {rotation}"
    elif config.rotation:
        reason += (f", not rotated ({channels} channels: no power-of-two block of {MIN_ROTATION_BLOCK} or more "
                   "divides them)")
    if config.stochastic_rounding:
        reason += ", rounded stochastically"
    keep_positive = _keeps_positive(group, config, bits, rotation)
    if keep_positive:
        reason += ", positive values kept positive (its backward reads which are)"
    nbytes = quantized_bytes(numel_hint(val), channels, bits, outliers, val.element_size(), chunk) + tables_bytes
    if nbytes >= owner.nbytes:
        return Plan("keep", f"quantizing would not shrink it ({nbytes} >= {owner.nbytes} bytes)")
    seconds = quantize_seconds(numel_hint(val), val.element_size(), bits, chunk, str(val.device), rotation=rotation,
                               stochastic=config.stochastic_rounding)
    return Plan("quantize", reason, bits=bits, channels=channels, merged=merged if merged > 1 else 0,
                outliers=outliers, chunk=chunk, rotation=rotation, stochastic=config.stochastic_rounding,
                keep_positive=keep_positive, replay=replay, nbytes=nbytes, seconds=seconds)


def _keeps_positive(group: list[SavedTensor], config: Config, bits: int, rotation: int) -> bool:
    """Whether a storage's positive values must stay positive: a backward of one of the tensors viewing it
    (``group``) reads which are (POSITIVE_MASK_BACKWARDS).
    Not at 1 bit (every positive value would come back as the channel's top), nor rotated or stochastically
    rounded codes, nor under static calibration, whose frozen range for a channel that was all zero while it
    calibrated would bring a later small value back as 1."""
    if bits < 2 or rotation or config.stochastic_rounding or config.calibration != "dynamic":
        return False
    return any(c in POSITIVE_MASK_BACKWARDS for s in group for c in s.backward_consumers)


def _refused_layout(val: torch.Tensor, inner: str, layout: str) -> Plan | None:
    """Why a tensor cannot be stored by rows of its innermost memory dimension (``inner``), or None."""
    if val.dim() < 2 or not val.dtype.is_floating_point or numel_hint(val) == 0:
        return Plan("keep", f"not a floating tensor with rows and {inner}")
    if memory_order(val) is None:
        return Plan("keep", f"not dense in memory: no {layout}")
    return None


def _attention_input(saved: SavedTensor) -> bool:
    """q, k or v saved as they are (not the X W lora_reorder rebuilds them from)."""
    return saved.role is Role.ATTN_QKV and saved.feeds_attention is not None


def _replay_source(owner: SavedTensor, analysis: Analysis, tables: set[str]) -> tuple[Node, Replay | None, int, str]:
    """For q, k or v after RoPE or GQA's repeat whose input is not saved anyway: compress that input instead
    and replay the rotation and repeat in backward. Returns the node to compress, the replay if it is not the
    saved storage, the bytes of the cos/sin tables this adds (those no earlier plan saves; their names are
    added to ``tables``) and the reason's suffix."""
    replay = owner.replay
    if replay is None or replay.source.name in analysis.saved_storages:
        return owner.base, None, 0, ""
    new_tables = list({t.name: t for t in map(storage_base, replay.tables)
                       if t.name not in analysis.saved_storages | tables}.values())
    tables.update(t.name for t in new_tables)
    return replay.source, replay, sum(storage_bytes(tensor_val(t)) for t in new_tables), f"; {replay.describe()}"


def _sparsify(owner: SavedTensor, ratio: float) -> Plan:
    val = tensor_val(owner.base)
    if any(not isinstance(s, int) for s in val.shape) or not val.is_contiguous():
        return Plan("keep", "attention probabilities with a symbolic or strided layout are kept")
    row = val.shape[-1]
    keep = max(1, math.ceil(ratio * row))
    nbytes = sparse_bytes(numel_hint(val), row, keep, val.element_size())
    return Plan("sparsify", f"largest {keep} of {row} per row kept (attn_sparsity: the probability mass each row "
                            "drops is not bounded)", keep=keep, nbytes=nbytes,
                seconds=recompute_seconds(numel_hint(val) * val.element_size() + nbytes, str(val.device)))


def _lowrank(owner: SavedTensor, analysis: Analysis, rank: float | int, tables_saved: set[str]) -> Plan:  # noqa: PYI041 (int: rank, float: ratio)
    node, replay, tables_bytes, replay_reason = _replay_source(owner, analysis, tables_saved)
    val = tensor_val(node)
    refused = _refused_layout(val, "a last dimension", "rows x last-dimension matrix to factor")
    if refused is not None:
        return refused
    order = memory_order(val)
    width = val.shape[order[-1]]
    if not isinstance(width, int):
        return Plan("keep", "symbolic last dimension: the rank is a fixed share of it")
    if owner.role is Role.ATTN_QKV and width <= hint(tensor_val(owner.node).shape[-1]):
        # A per-head layout (GPT-2's per-head copies; MQA's single k/v head): factors of one head's width
        # share one small subspace across all heads, far worse than factors of a projection's output, which
        # spans several heads (wider than the saved tensor's last dimension).
        return Plan("keep", f"per-head layout ({numel_hint(val) // width} x {width}): q, k, v are factored only as "
                    "their projection's output")
    k = resolve_rank(rank, (width, width))  # from the last dimension alone: the row count may be symbolic
    rows = numel_hint(val) // width
    nbytes = lowrank_bytes((rows, width), k, val.element_size()) + tables_bytes
    if nbytes >= owner.nbytes:
        return Plan("keep", f"rank-{k} factors would not shrink it ({nbytes} >= {owner.nbytes} bytes)")
    return Plan("lowrank", f"rank {k} of {width}, as {rows} x {width}{replay_reason}", rank=k, replay=replay,
                nbytes=nbytes, seconds=lowrank_seconds(rows, width, k, DEFAULT_NITER, str(val.device)))


# A preset's error tiers (fit_ceilings). Its widths are configured, so what is left to choose is whether a storage
# is held exact or at the 8 bits backward rebuilds from (REBUILD_SOURCE_BITS), rounded coarser, or factored.
EXACT_TIER, ROUNDED_TIER, FACTORED_TIER = 0, 1, 2


def _rebuilds_from_x(config: Config) -> bool:
    """``rebuild_from_x`` with the lora_reorder that saves X W (a preset's, turned off, leaves it set)."""
    return config.rebuild_from_x and config.lora_reorder


def _tier(plan: Plan) -> int:
    if plan.action == "lowrank" or (plan.action == "prenorm" and plan.bits is None):
        return FACTORED_TIER
    if plan.action == "sparsify" or (plan.action in ("quantize", "prenorm") and plan.bits < REBUILD_SOURCE_BITS):
        return ROUNDED_TIER
    return EXACT_TIER


@dataclass(frozen=True)
class _Choice:
    """A preset's option for one storage: its plan, and the storages whose x it makes a rebuild source (raised to
    REBUILD_SOURCE_BITS: _rebuild_source), each with what backward rebuilds from it."""

    plan: Plan
    raises: tuple[tuple[str, str], ...] = ()


# What backward rebuilds from a raised source: its reason names the X W where it serves both.
_REPLAYED_X_W = "an X W"
_NORM_INPUT = "its norm's input"


def fit_ceilings(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], held: dict[str, Plan | None],
                 config: Config, tables_saved: set[str], techniques: Sequence[TechniqueHooks],
                 demoted: Mapping[str, int] | None = None) -> dict[str, Plan]:
    """Without memory_budget, each storage's target is its ceiling: the bytes of the compression the config asks of it
    (_configured_plan), or of a norm input rebuilt from its output's factors with ``prenorm_sharing``. Its options
    (_choices): that compression, at REBUILD_SOURCE_BITS or more where backward rebuilds something from it;
    with ``rebuild_from_x`` the experts' products replayed from what is held at REBUILD_SOURCE_BITS or more;
    recomputed element-wise from storages the config keeps exact (from a quantized one it would carry that error
    rather than its own, which is not less: a norm's output rebuilt from its input quantized per row bent q_proj's
    A gradient more than the output's own codes did); with ``rebuild_from_x`` an X W replayed from its
    x where its codes are coarser than 8 bits; a norm's input rebuilt from its output's factors (``prenorm_sharing``)
    or, with ``rebuild_from_x``, from its output's codes at 8 bits.

    One rule chooses, the one memory_budget spends by (fit_budget) against a target per storage instead of per
    region: among the options within the ceiling, the least error tier (_tier), then the fewest seconds per byte
    saved, then the most bytes saved; where none is within it, the fewest bytes. A storage the config keeps is not
    moved. The X W replayed from one x are weighed with x (_replayable). The bytes a rebuilt norm input adds to its
    output, raised to 8 bits, count against no ceiling: ``rebuild_from_x`` asks for them (at 2 bits a norm's input
    bends the gradient far more than one rebuilt from its output at 8; measured: docs/quantization.md). A storage
    is chosen again when a plan it reads changes (its x, its norm's output) or an option raises it.
    ``block_offload`` then puts a checkpointed block's input in host memory, as its plan stores it. A storage the
    guard ``demoted`` (storage -> steps) has that many steps less lossy a compression configured (_demoted_plan)."""
    demoted = demoted or {}
    configured = {storage: plan or _demoted_plan(by_storage[storage][0], by_storage[storage], analysis, config,
                                                 tables_saved, techniques, demoted.get(storage, 0))
                  for storage, plan in held.items()}
    plans = dict(configured)
    raised: dict[str, list[str]] = {}  # storage -> what backward rebuilds from it, where an option raised it
    replayable = _replayable(analysis, by_storage, configured, config, tables_saved)
    readers: dict[str, set[str]] = {}  # storage -> the storages whose options read its plan
    for storage, source in replayable.items():
        readers.setdefault(source, set()).add(storage)
    for storage, group in by_storage.items():
        if group[0].role is Role.NORM_INPUT and group[0].norm is not None:
            readers.setdefault(group[0].norm.output.name, set()).add(storage)
        for leaf in rebuild_inputs(group[0].recompute) if group[0].recompute is not None else ():
            readers.setdefault(leaf.name, set()).add(storage)  # its recomputation may read it as planned
    pending = [storage for storage, plan in configured.items() if plan.action != "keep"]
    # what the config asks of each: fixed by it, whatever the others choose
    ceilings = {storage: _ceiling(by_storage[storage][0], by_storage[storage], configured[storage], analysis, config,
                                  tables_saved) for storage in pending}
    while pending:
        storage = pending.pop(0)
        if configured[storage].action == "keep":  # kept by the config, a source raised or not
            continue
        choice = _choose(storage, by_storage, configured, plans, raised, replayable, ceilings[storage], analysis,
                         config, tables_saved)
        changed = choice.plan != plans[storage]
        plans[storage] = choice.plan
        for source, purpose in choice.raises:
            if purpose not in raised.setdefault(source, []):
                raised[source].append(purpose)
                pending.append(source)
        if changed:
            pending.extend(readers.get(storage, ()))
    for storage, group in by_storage.items():
        if config.block_offload and _offloadable(group[0], group, plans[storage], analysis):
            plans[storage] = _offloaded(group[0], plans[storage])
    return plans


def _choose(storage: str, by_storage: dict[str, list[SavedTensor]], configured: dict[str, Plan],
            plans: dict[str, Plan], raised: dict[str, list[str]], replayable: dict[str, str], ceiling: int,
            analysis: Analysis, config: Config, tables_saved: set[str]) -> _Choice:
    """fit_ceilings' rule for one storage, from the plans now; ``ceiling``: what the config asks of it
    (_ceiling)."""
    owner = by_storage[storage][0]
    choices = _choices(owner, by_storage, configured, plans, raised, replayable, analysis, config, tables_saved)
    ceiling = min([ceiling] + [c.plan.nbytes for c in choices if c.plan.action == "prenorm" and c.plan.bits is None])
    within = [c for c in choices if stored_bytes(owner, c.plan) <= ceiling]
    if not within:
        return min(choices, key=lambda c: stored_bytes(owner, c.plan))

    def key(choice: _Choice) -> tuple[int, float, int]:
        saved = owner.nbytes - stored_bytes(owner, choice.plan)
        return _tier(choice.plan), choice.plan.seconds / saved if saved > 0 else math.inf, -saved

    best = min(within, key=key)
    if best is choices[0]:
        return best
    base = choices[0].plan
    return dataclasses.replace(best, plan=dataclasses.replace(
        best.plan, reason=f"{best.plan.reason}, against {base.seconds * 1e3:.3g} ms for its {_stored_as(base)}"))


def _stored_as(plan: Plan) -> str:
    """What a quantize or lowrank plan stores, for a reason."""
    return f"rank-{plan.rank} factors" if plan.action == "lowrank" else f"{plan.bits}-bit codes"


def _replayable(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], configured: dict[str, Plan],
                config: Config, tables_saved: set[str]) -> dict[str, str]:
    """The X W ``rebuild_from_x`` may replay, each with its x: configured below REBUILD_SOURCE_BITS (or at it only for
    rebuild_refusal), x kept or quantized, and the X W of one x together where their codes outweigh what x's codes at
    REBUILD_SOURCE_BITS add to its configured ones: the ceilings of the move (the X W and x) hold it. Against 8-bit
    codes a matmul would buy bytes the config did not ask for, at the machine's measured flops per byte. Counted so
    because a replayed product is back in backward beside the rest: without the count, hyclora-2bit with
    qkv_bits=None on whatif's Llama-3-8B replayed GQA's narrow q, k and v, for fewer saved bytes and a higher
    predicted peak (measured: docs/cost_model.md)."""
    if not _rebuilds_from_x(config):
        return {}
    by_source: dict[str, list[str]] = {}
    for storage, group in by_storage.items():
        owner, plan = group[0], configured[storage]
        coarse = plan.action == "quantize" and (plan.bits < REBUILD_SOURCE_BITS or _held_for_refusal(owner, config))
        source = _replay_source_storage(owner, by_storage) if coarse else None
        if source is not None and configured[source].action in ("keep", "quantize"):
            by_source.setdefault(source, []).append(storage)
    replayable = {}
    for source, products in by_source.items():
        group, before = by_storage[source], configured[source]
        after = before if before.action == "keep" else _rebuild_source(group[0], group, analysis, config,
                                                                         set(tables_saved), _REPLAYED_X_W)
        if sum(configured[p].nbytes for p in products) > stored_bytes(group[0], after) - stored_bytes(group[0], before):
            replayable.update(dict.fromkeys(products, source))
    return replayable


def _held_for_refusal(owner: SavedTensor, config: Config) -> bool:
    """An X W held at 8 bits, above the preset's width, only because it feeds GELU, tanh or ReLU (rebuild_refusal)."""
    return config.bits is not None and owner.role is Role.LORA_BASE_OUTPUT and _lowest_bits(owner) > config.bits


def _ceiling(owner: SavedTensor, group: list[SavedTensor], plan: Plan, analysis: Analysis, config: Config,
             tables_saved: set[str]) -> int:
    """The bytes of the compression the config asks of a storage: an X W that feeds GELU, tanh or ReLU at the
    preset's width, not the 8 bits it is held at unless replayed (rebuild_refusal)."""
    if _rebuilds_from_x(config) and plan.action == "quantize" and _held_for_refusal(owner, config):
        at_width = _quantize(owner, group, analysis, config, set(tables_saved), config.bits)
        if at_width.action == "quantize":
            return at_width.nbytes
    return stored_bytes(owner, plan)


def _choices(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], configured: dict[str, Plan],
             plans: dict[str, Plan], raised: dict[str, list[str]], replayable: dict[str, str], analysis: Analysis,
             config: Config, tables_saved: set[str]) -> list[_Choice]:
    """fit_ceilings' options for a storage the config compresses, its configured compression first."""
    storage, group = owner.storage, by_storage[owner.storage]
    base = configured[storage]
    if storage in raised and base.action == "quantize":
        purpose = _REPLAYED_X_W if _REPLAYED_X_W in raised[storage] else raised[storage][0]
        base = _rebuild_source(owner, group, analysis, config, set(tables_saved), purpose)
    choices = [_Choice(base)]
    leaves = [n.name for n in rebuild_inputs(owner.recompute)] if owner.recompute is not None else []
    if all(_rebuildable_from(leaf, owner, base, configured, plans, config) for leaf in leaves):
        recompute = _recompute_plan(owner, by_storage, plans)
        if recompute is not None:
            choices.append(_Choice(dataclasses.replace(
                recompute, reason=f"{recompute.reason}, {recompute.seconds * 1e3:.3g} ms")))
    source = replayable.get(storage)
    if source is not None and plans[source].action in ("keep", "quantize"):
        choices.append(_Choice(_replayed(owner, source), ((source, _REPLAYED_X_W),)))
    choices.extend(_prenorm_choices(owner, by_storage, plans, analysis, config, tables_saved))
    return choices


def replay_sources(recomputed: list[tuple[SavedTensor, Plan]]) -> frozenset[str]:
    """What the region's replays read, for the partition that runs them to hold at REBUILD_SOURCE_BITS or more: an X
    W's x; for the experts' replayed products, what they read through the recomputations between (the routed rows
    gathered again from the router's input)."""
    chains = {saved.storage: plan.chain for saved, plan in recomputed}
    sources = {n.name for saved, plan in recomputed if plan.chain == saved.rebuild_product
               for n in rebuild_inputs(plan.chain)}
    stack = [n.name for _, plan in recomputed if replays_product(plan.chain) for n in rebuild_inputs(plan.chain)]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in chains:
            stack.extend(n.name for n in rebuild_inputs(chains[name]))
        else:
            sources.add(name)
    return frozenset(sources)


def _rebuildable_from(leaf: str, owner: SavedTensor, owner_plan: Plan, configured: dict[str, Plan],
                      plans: dict[str, Plan], config: Config) -> bool:
    """A recomputation may read ``leaf``: kept as configured; where the chain replays the experts' products, under
    ``rebuild_from_x`` held at REBUILD_SOURCE_BITS as planned now (as a dense X W is replayed from its x); where it
    only copies values (the experts' routed rows gathered from the tokens), configured at no fewer bits than
    ``owner`` would be."""
    if replays_product(owner.recompute):
        return _rebuilds_from_x(config) and _held_at_source_bits(leaf, plans)
    plan = configured.get(leaf, Plan("keep", ""))
    if plan.action == "keep":
        return True
    return (plan.action == "quantize" and owner_plan.action == "quantize" and plan.bits >= owner_plan.bits
            and copies_values(owner.recompute))


def _held_at_source_bits(storage: str, plans: dict[str, Plan]) -> bool:
    """``storage`` as planned now is kept, stored at REBUILD_SOURCE_BITS or more, or recomputed from such alone."""
    plan = plans.get(storage, Plan("keep", ""))
    if plan.action == "recompute" and plan.chain:
        return all(_held_at_source_bits(n.name, plans) for n in rebuild_inputs(plan.chain))
    return plan.action == "keep" or (plan.action == "quantize" and plan.bits >= REBUILD_SOURCE_BITS)


def _prenorm_choices(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], plans: dict[str, Plan],
                     analysis: Analysis, config: Config, tables_saved: set[str]) -> list[_Choice]:
    """A norm's saved input (RMSNorm's input, LayerNorm's x_hat or x) rebuilt from its output: from the output's factors
    with ``prenorm_sharing`` (LoRAct's pre-norm sharing); with ``rebuild_from_x`` from the output's codes at
    REBUILD_SOURCE_BITS, the output raised to them where it is a linear's input (as rebuild_from_x holds every x)."""
    unit = owner.norm
    output_plan = _output_plan(unit, plans) if owner.role is Role.NORM_INPUT and unit is not None else None
    if output_plan is None:
        return []
    output = unit.output.name
    choices = []
    if config.prenorm_sharing and output_plan.action == "lowrank":
        choices.append(_Choice(_prenorm(owner, analysis, output, output_plan)))
    if _rebuilds_from_x(config) and output_plan.action == "quantize":
        if output_plan.bits >= REBUILD_SOURCE_BITS:
            choices.append(_Choice(_prenorm(owner, analysis, output, output_plan)))
        elif any(Role.LINEAR_INPUT in (s.role, *s.also) for s in by_storage[output]):
            group = by_storage[output]
            raised = _rebuild_source(group[0], group, analysis, config, set(tables_saved), _NORM_INPUT)
            if raised.action == "quantize":
                choices.append(_Choice(_prenorm(owner, analysis, output, raised), ((output, _NORM_INPUT),)))
    return choices


def _output_plan(unit: NormUnit, plans: dict[str, Plan]) -> Plan | None:
    """How a norm's output is stored as planned now: its own plan, or the plan of a tensor compressed through it (a
    per-head q or k norm's output, stored before RoPE for the q or k rotated from it); None if neither."""
    name = unit.output.name
    if name in plans:
        return plans[name]
    return next((plan for plan in plans.values() if plan.replay is not None and plan.source == name), None)


def _prenorm(owner: SavedTensor, analysis: Analysis, output: str, output_plan: Plan) -> Plan:
    """A norm's saved input rebuilt in backward from its output ``output``, stored as ``output_plan``, and the
    channels with the smallest |gamma| saved exactly (PRENORM_EXACT_SHARE)."""
    unit = owner.norm
    val = tensor_val(unit.x)
    width = tensor_val(unit.normalized).shape[-1]  # the norm's: a head's where it reads x split into heads
    exact = max(1, math.ceil(PRENORM_EXACT_SHARE * width))
    # rstd and mean saved for the rebuild where backward does not keep them as they are
    added = [n for n in (unit.rstd, unit.mean) if n is not None and storage_base(n).name not in analysis.saved_storages]
    nbytes = prenorm_bytes(numel_hint(val) // width, exact, val.element_size()) + sum(
        storage_bytes(tensor_val(n)) for n in added)
    formula = "(output - beta) / gamma" if unit.beta is not None else "output / gamma"
    formula += " / rstd" if unit.rstd is not None else ""
    formula += " + mean" if unit.mean is not None else ""
    # element-wise from the output backward reads anyway: the rebuilt input written and read once
    seconds = recompute_seconds(storage_bytes(val), str(val.device))
    return Plan("prenorm", f"rebuilt as {formula} from {output}'s {_stored_as(output_plan)}; {exact} smallest-|gamma| "
                f"channel{'s' if exact > 1 else ''} exact", rank=output_plan.rank,
                bits=output_plan.bits if output_plan.action == "quantize" else None, exact_channels=exact, norm=unit,
                nbytes=nbytes, seconds=seconds)


# The error class of a memory_budget option: exact ones first (recompute, an X W replayed from its x, a block's input
# waiting in host memory), then quantization down BUDGET_STAGES, then low-rank factors, whose error no bit width
# bounds (a rank keeps a subspace, not a range): a storage is factored only once its quantization reached its floor.
EXACT_ERROR = 0
LOWRANK_ERROR = len(BUDGET_STAGES) + 1


@dataclass(frozen=True)
class Option:
    """One typed way to hold a saved storage between forward and backward (recompute, replay, quantize b, low-rank
    k, offload; keep is where every storage starts): its plan, which prices it in device bytes and seconds, and its
    error class."""

    storage: str
    plan: Plan
    error: int
    tables: frozenset[str] = frozenset()  # RoPE tables the plan pays for, added to the region's once it is chosen


@dataclass
class _Spending:
    """What memory_budget's moves so far constrain."""

    floors: dict[str, int]  # the fewest bits a storage may go to: backward rebuilds something from it
    # storages recomputed in backward (element-wise, replayed, or with their checkpointed block)
    recomputed: set[str] = field(default_factory=set)
    read_by_recompute: set[str] = field(default_factory=set)  # storages those recomputations read: they stay saved
    checkpointed: set[str] = field(default_factory=set)  # blocks checkpointed
    added: set[str] = field(default_factory=set)  # storages a checkpointed block saves that nothing saved before


@dataclass(frozen=True)
class _BlockParts:
    """A block as memory_budget's checkpoint of it moves storages: those its forward makes but its outputs (freed,
    recomputed with it) and its sources (analysis.blocks.Block.sources: saved, at their floor or finer)."""

    block: Block
    inside: tuple[str, ...]
    sources: dict[str, Node]  # storage -> its base node

    @staticmethod
    def of(block: Block, analysis: Analysis, by_storage: dict[str, list[SavedTensor]]) -> _BlockParts:
        sources = {storage_base(node).name: storage_base(node) for node in block.sources}
        inside = tuple(storage for storage, group in by_storage.items()
                       if group[0].layer == block.name and group[0].frees_memory and storage not in sources
                       and storage not in analysis.output_storages)
        return _BlockParts(block, inside, sources)


@dataclass(frozen=True)
class BlockOption:
    """memory_budget's block checkpoint (``block_checkpoint``): the new plans of the storages it moves, and the
    sources it saves that nothing saved before (``added``, storage -> bytes)."""

    block: str
    plans: dict[str, Plan]
    added: dict[str, int]


def fit_budget(analysis: Analysis, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
               config: Config, tables_saved: set[str], frozen: set[str] | frozenset[str] = frozenset()) -> None:
    """memory_budget: one rule over every typed option (``budget_options``, and a block checkpoint per block the
    analysis offers, ``_block_move``). From the exact plan, each step takes the option of the least error class, the
    fewest seconds per byte it saves within it (the most bytes saved on a tie), among every option that saves
    device bytes; until the region fits its target or no option is left (budget_note then says the target is not
    met). A move that changes another storage's options (a RoPE table paid, a storage a recomputation reads moved)
    prices that storage, and the blocks holding it, again. The ``frozen`` storages (the guard's) are not moved."""
    target = budget_bytes(analysis, config)
    total = sum(planned_bytes(group[0], owner_plans[storage]) for storage, group in by_storage.items())
    free = [storage for storage, group in by_storage.items()
            if storage not in frozen and _held_as_is(group[0], group, analysis) is None]
    free_set = set(free)
    # the analysis' rebuild sources: the first partition's replayed X W's x, a chunked op's or a checkpointed
    # block's input
    spending = _Spending({storage: _source_bits(by_storage[storage][0], config)
                          for storage in analysis.rebuild_sources if storage in by_storage})
    readers: dict[str, set[str]] = {}  # the storages whose element-wise recomputation reads each storage
    for storage in free:
        chain = by_storage[storage][0].recompute
        for node in rebuild_inputs(chain) if chain is not None else ():
            readers.setdefault(node.name, set()).add(storage)
    # blocks drawing random numbers are not offered (backend.py reports them)
    blocks = {b.name: _BlockParts.of(b, analysis, by_storage) for b in analysis.blocks if b.random is None}
    holding: dict[str, set[str]] = {}  # the blocks whose checkpoint moves or saves each storage
    for parts in blocks.values():
        for storage in (*parts.inside, *parts.sources):
            holding.setdefault(storage, set()).add(parts.block.name)
    heap: list[tuple[tuple[int, float, int], int, Option | BlockOption]] = []
    counter = 0
    # pushed in graph order, blocks last: equal keys then pop by that order, not by a set's (hash-seeded) order
    position = {unit: index for index, unit in enumerate([*free, *blocks])}

    def move(unit: str) -> tuple[tuple[int, float, int], Option | BlockOption] | None:
        if unit in blocks:
            return _block_move(blocks[unit], by_storage, owner_plans, config, spending)
        return _next_move(unit, analysis, by_storage, owner_plans, config, tables_saved, spending)

    def push(units: set[str] | list[str]) -> None:
        nonlocal counter
        for unit in sorted(units, key=position.__getitem__):
            found = move(unit)
            if found is not None:
                heapq.heappush(heap, (found[0], counter, found[1]))
                counter += 1

    push([*free, *blocks])
    while total > target and heap:
        key, _, option = heapq.heappop(heap)
        unit = option.block if isinstance(option, BlockOption) else option.storage
        fresh = move(unit)
        if fresh is None:
            continue
        if fresh[0] != key or fresh[1] != option:  # another move changed what this one reads: priced again
            push([unit])
            continue
        if isinstance(option, BlockOption):
            total += _checkpoint(option, blocks[option.block], by_storage, owner_plans, config, spending)
            repriced = option.plans.keys() | option.added.keys()
        else:
            owner = by_storage[option.storage][0]
            total += planned_bytes(owner, option.plan) - planned_bytes(owner, owner_plans[option.storage])
            owner_plans[option.storage] = dataclasses.replace(option.plan,
                                                              reason=f"{option.plan.reason} (memory_budget)")
            tables_saved.update(option.tables)
            repriced = {option.storage, *readers.get(option.storage, ())} | (free_set if option.tables else set())
            if option.plan.action == "recompute":
                spending.recomputed.add(option.storage)
                read = {n.name for n in rebuild_inputs(option.plan.chain)}
                spending.read_by_recompute |= read
                repriced |= read
                if option.plan.chain is owner.rebuild_product:  # replayed: x stays at REBUILD_SOURCE_BITS or more
                    source = _replay_source_storage(owner, by_storage)
                    spending.floors[source] = max(spending.floors.get(source, 0), REBUILD_SOURCE_BITS)
        push(repriced & free_set)
        push(set().union(*(holding.get(storage, ()) for storage in repriced)) - spending.checkpointed)


def _block_move(parts: _BlockParts, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
                config: Config, spending: _Spending) -> tuple[tuple[int, float, int], BlockOption] | None:
    """Checkpointing a block from the plans now, with its key, or None where it saves no device bytes or cannot be
    taken: a storage it would free is read by a recomputation outside it. Its error class is its sources' (exact
    where they are kept exact); its seconds are the block's forward run again less the seconds of the plans it
    replaces."""
    name = parts.block.name
    if name in spending.checkpointed:
        return None
    outside = spending.recomputed.difference(parts.inside, parts.sources)
    if {n.name for storage in outside for n in rebuild_inputs(owner_plans[storage].chain)} & set(parts.inside):
        return None
    floor = _block_source_bits(config)
    plans: dict[str, Plan] = {}
    added = {}
    for storage, node in parts.sources.items():
        if storage not in by_storage:
            if storage not in spending.added:
                added[storage] = storage_bytes(tensor_val(node))
            continue
        plan = owner_plans[storage]
        if not (plan.action == "keep" or (plan.action == "quantize" and plan.bits >= floor)):
            plans[storage] = Plan("keep", f"what {name} is recomputed from in backward: kept exact")
    freed = {storage: Plan("checkpoint", "", nbytes=0) for storage in parts.inside}
    changed = plans | freed
    saved = sum(planned_bytes(by_storage[s][0], owner_plans[s]) - planned_bytes(by_storage[s][0], p)
                for s, p in changed.items()) - sum(added.values())
    if saved <= 0:
        return None
    device = next(str(v.device) for v in map(tensor_val, parts.block.nodes) if v is not None)
    forward = forward_seconds(parts.block.nodes, device)
    seconds = forward + sum(p.seconds - owner_plans[s].seconds for s, p in changed.items())
    error = max((_error(by_storage[s][0], changed.get(s, owner_plans[s])) for s in parts.sources if s in by_storage),
                default=EXACT_ERROR)
    checkpointed = Plan("checkpoint", f"{BLOCK_CHECKPOINT_REASON}{name}: a {forward * 1e3:.3g} ms forward for "
                                      f"{saved / 2**20:.2f} MiB", nbytes=0)
    plans |= dict.fromkeys(parts.inside, checkpointed)
    return (error, seconds / saved, -saved), BlockOption(name, plans, added)


# The reason of a storage memory_budget recomputes with its checkpointed block: the block's name and price follow.
BLOCK_CHECKPOINT_REASON = "recomputed in backward with its block, "


def _checkpoint(option: BlockOption, parts: _BlockParts, by_storage: dict[str, list[SavedTensor]],
                owner_plans: dict[str, Plan], config: Config, spending: _Spending) -> int:
    """Applies a block checkpoint; returns the device bytes it adds (negative: saves)."""
    change = sum(option.added.values())
    for storage, plan in option.plans.items():
        owner = by_storage[storage][0]
        change += planned_bytes(owner, plan) - planned_bytes(owner, owner_plans[storage])
        owner_plans[storage] = dataclasses.replace(plan, reason=f"{plan.reason} (memory_budget)")
        if plan.action == "checkpoint":
            spending.recomputed.add(storage)
        else:  # a source saved again
            spending.recomputed.discard(storage)
    spending.read_by_recompute |= parts.sources.keys()
    floor = _block_source_bits(config)
    for storage in parts.sources.keys() & by_storage.keys():
        spending.floors[storage] = max(spending.floors.get(storage, 0), floor)
    spending.added |= option.added.keys()
    spending.checkpointed.add(option.block)
    return change


def _next_move(storage: str, analysis: Analysis, by_storage: dict[str, list[SavedTensor]],
               owner_plans: dict[str, Plan], config: Config, tables_saved: set[str],
               spending: _Spending) -> tuple[tuple[int, float, int], Option] | None:
    """The best option ``storage`` can move to now that saves device bytes, with its key, or None."""
    owner, plan = by_storage[storage][0], owner_plans[storage]
    before = planned_bytes(owner, plan)
    best = None
    for option in budget_options(owner, by_storage, analysis, owner_plans, config, tables_saved, spending):
        saved = before - planned_bytes(owner, option.plan)
        if saved <= 0:
            continue
        key = (option.error, (option.plan.seconds - plan.seconds) / saved, -saved)
        if best is None or key < best[0]:
            best = key, option
    return best


def budget_options(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], analysis: Analysis,
                   owner_plans: dict[str, Plan], config: Config, tables_saved: set[str],
                   spending: _Spending) -> list[Option]:
    """The options memory_budget weighs for ``owner``'s storage from its plan now: recomputed element-wise from what
    stays saved; an X W replayed from its x (``rebuild_from_x``), x then held at REBUILD_SOURCE_BITS or more; a
    checkpointed block's input in host memory (``block_offload``, on a device whose host memory is apart from it);
    quantized at each BUDGET_STAGES width below its plan's and at or above its floor; factored at ``lowrank``'s
    rank. A storage a recomputation reads stays saved; one recomputed is not moved again. Pre-norm sharing, the
    preset's sparsified probabilities and the experts' replayed products are not among them."""
    storage, group = owner.storage, by_storage[owner.storage]
    plan = owner_plans[storage]
    if plan.action not in ("keep", "quantize", "lowrank") or plan.host:
        return []
    options = []
    if storage not in spending.read_by_recompute:
        recompute = _recompute_plan(owner, by_storage, owner_plans)
        # not the experts' products: this solver holds no floor under what they replay from
        if (recompute is not None and not replays_product(recompute.chain)
                and not spending.recomputed & {n.name for n in rebuild_inputs(recompute.chain)}):
            options.append(Option(storage, recompute, EXACT_ERROR))
        replay = _replay_plan(owner, by_storage, owner_plans, config)
        if replay is not None and _replay_source_storage(owner, by_storage) not in spending.recomputed:
            options.append(Option(storage, replay, EXACT_ERROR))
    if config.block_offload and _offloadable(owner, group, plan, analysis) and _host_apart(owner):
        options.append(Option(storage, _offloaded(owner, plan), _error(owner, plan)))
    if plan.action == "lowrank":
        return options
    # the RoPE tables a quantized plan pays for stay saved with what replaces it: they stay in its bytes
    held_tables = 0 if plan.action == "keep" else plan.nbytes - _quantize(
        owner, group, analysis, config, set(tables_saved), plan.bits).nbytes
    lower = []
    if _quantizable(group, config):
        floor = max(_lowest_bits(owner), spending.floors.get(storage, 0))
        lower = [bits for bits, sensitivity in BUDGET_STAGES if sensitivity == _sensitivity(owner)
                 and bits >= floor and (plan.action == "keep" or bits < plan.bits)]
    for bits in lower:
        tables = set(tables_saved)
        lowered = _quantize(owner, group, analysis, config, tables, bits)
        if lowered.action == "quantize":
            options.append(Option(storage, dataclasses.replace(lowered, nbytes=lowered.nbytes + held_tables),
                                  _error(owner, lowered), frozenset(tables - tables_saved)))
    if config.lowrank is not None and storage not in spending.floors:
        tables = set(tables_saved)
        factored = propose_lowrank(owner, group, analysis, config, tables)
        if factored is not None and factored.action == "lowrank":
            options.append(Option(storage, dataclasses.replace(factored, nbytes=factored.nbytes + held_tables),
                                  LOWRANK_ERROR, frozenset(tables - tables_saved)))
    return options


def _host_apart(owner: SavedTensor) -> bool:
    """Whether host memory is apart from the memory ``owner`` lives in: on a CPU it is the same, and offloading
    saves nothing."""
    return tensor_val(owner.base).device.type != "cpu"


def _source_bits(owner: SavedTensor, config: Config) -> int:
    """The fewest bits of a storage backward rebuilds something from: a checkpointed block's input at
    Config.block_input_bits where set, else REBUILD_SOURCE_BITS (as _rebuild_source plans it)."""
    return _block_source_bits(config) if BLOCK_SOURCE in owner.base.meta else REBUILD_SOURCE_BITS


def _block_source_bits(config: Config) -> int:
    return config.block_input_bits if config.block_input_bits is not None else REBUILD_SOURCE_BITS


def _error(owner: SavedTensor, plan: Plan) -> int:
    """``plan``'s error class under memory_budget."""
    if plan.action == "quantize":
        return 1 + BUDGET_STAGES.index((plan.bits, _sensitivity(owner)))
    return LOWRANK_ERROR if plan.action == "lowrank" else EXACT_ERROR


def _replay_source_storage(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]]) -> str | None:
    """The one saved storage an X W's matmul replays from (its x; the weight frees nothing), or None."""
    if owner.rebuild_product is None:
        return None
    leaves = [n.name for n in rebuild_inputs(owner.rebuild_product)
              if n.name in by_storage and by_storage[n.name][0].frees_memory]
    return leaves[0] if len(leaves) == 1 else None


def _replay_plan(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]], owner_plans: dict[str, Plan],
                 config: Config) -> Plan | None:
    """``rebuild_from_x``: an X W rebuilt in backward by replaying its matmul from its x, where x is kept or stored at
    REBUILD_SOURCE_BITS or more, priced by the matmul's flops; None where it cannot be."""
    source = _replay_source_storage(owner, by_storage) if config.rebuild_from_x else None
    if source is None:
        return None
    x = owner_plans[source]
    if not (x.action == "keep" or (x.action == "quantize" and x.bits >= REBUILD_SOURCE_BITS)):
        return None
    return _replayed(owner, source)


def _replayed(owner: SavedTensor, source: str) -> Plan:
    """An X W rebuilt in backward by replaying its matmul from ``source`` (its x), priced by the matmul's flops."""
    product = owner.rebuild_product[-1]
    out = tensor_val(product)  # 2-d from mm, or (batch, tokens, out) from an NF4 gemm
    rows, cols = numel_hint(out) // hint(out.shape[-1]), hint(out.shape[-1])
    inner = hint(tensor_val(matmul_operands(product)[0]).shape[-1])
    seconds = product_seconds(rows, inner, cols, str(out.device))
    return Plan("recompute", f"rebuilt in backward as x W^T from {source} and the frozen weight: a matmul, "
                f"{seconds * 1e3:.3g} ms", nbytes=0, seconds=seconds, chain=owner.rebuild_product)


# What passes/offload_blocks.py moves: the tensor itself, or the tensors compress_storage saved in its place.
_OFFLOADABLE = ("keep", "quantize", "lowrank")


def _offloadable(owner: SavedTensor, group: list[SavedTensor], plan: Plan, analysis: Analysis) -> bool:
    """Whether a checkpointed block's input, planned ``plan``, can wait in host memory (block_offload)."""
    # kept exact, the storage moves only where it is saved once, as itself (a saved view would hold it here)
    kept_whole = plan.action != "keep" or (len(group) == 1 and owner.node is owner.base)
    return BLOCK_SOURCE in owner.base.meta and owner.frees_memory and owner.storage not in analysis.output_storages \
        and plan.action in _OFFLOADABLE and kept_whole and not plan.host


def _offloaded(owner: SavedTensor, plan: Plan) -> Plan:
    seconds = _offload_seconds(owner, plan)
    return dataclasses.replace(
        plan, host=True, seconds=plan.seconds + seconds,
        reason=f"{plan.reason}; in host memory between forward and backward ({stored_bytes(owner, plan)} bytes "
               f"there and back, {seconds * 1e3:.3g} ms)")


def on_device(plan: Plan, owner: SavedTensor, why: str) -> Plan:
    """``plan`` (a block_offload plan) with its storage left on the device, and ``why``."""
    return dataclasses.replace(plan, host=False, seconds=plan.seconds - _offload_seconds(owner, plan),
                               reason=f"{plan.reason}; left on the device: {why}")


def _offload_seconds(owner: SavedTensor, plan: Plan) -> float:
    return offload_seconds(stored_bytes(owner, plan), str(tensor_val(owner.base).device))


def _rebuild_source(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                    tables: set[str], purpose: str) -> Plan:
    """The plan of an x that backward rebuilds another tensor from (``purpose`` names it): REBUILD_SOURCE_BITS, or
    a checkpointed block's input at Config.block_input_bits."""
    plan = _quantize(owner, group, analysis, config, tables, _source_bits(owner, config))
    if plan.action != "quantize":
        return plan
    return dataclasses.replace(plan, reason=f"{plan.reason}; {purpose} rebuilt from it in backward")


def budget_bytes(analysis: Analysis, config: Config) -> float:
    """memory_budget in bytes: as given, or its fraction of what torch.compile's own partition saves (of what the
    region saves as partitioned where that was not measured)."""
    if config.budget_in_bytes():
        return config.memory_budget
    reference = analysis.exact_bytes if analysis.exact_bytes is not None else sum(s.nbytes for s in analysis.saved)
    return config.memory_budget * reference


def _lowest_bits(owner: SavedTensor) -> int:
    """An X W that lora_reorder rebuilds a GELU, tanh or ReLU input from stays at the width that decision assumed
    (rebuild_refusal), unless rebuild_from_x replays it."""
    if owner.role is Role.LORA_BASE_OUTPUT and owner.rebuilt_for in DERIVATIVE_SAVED_ACTIVATIONS:
        return REBUILD_ALL_ACTIVATIONS_BITS
    if owner.role is Role.ROW_SCALED:
        return ROW_SCALED_BITS
    return min(BITS_CHOICES)


def _sensitivity(owner: SavedTensor) -> int:
    if (owner.feeds_attention or owner.reaches_attention) is not None:
        return 3
    if Role.LINEAR_INPUT in (owner.role, *owner.also):
        return 2
    return 1 if owner.role is Role.NORM_INPUT else 0


def budget_note(analysis: Analysis, plans: list[Plan], config: Config) -> tuple[str, bool] | None:
    """The report's note on the region's plan against memory_budget and whether the plan fits it; None without
    a budget."""
    if config.memory_budget is None:
        return None
    target = budget_bytes(analysis, config)
    planned = sum(planned_bytes(s, p) for s, p in zip(analysis.saved, plans, strict=True))
    reference = analysis.exact_bytes if analysis.exact_bytes is not None else sum(s.nbytes for s in analysis.saved)
    amounts = (f"{planned / 2**20:.2f} MiB saved against a target of {target / 2**20:.2f} MiB "
               f"({planned / reference if reference else 0:.1%} of the {reference / 2**20:.2f} MiB "
               f"{'torch.compile saves' if analysis.exact_bytes is not None else 'saved as partitioned'})")
    if planned <= target:
        return f"memory_budget {config.memory_budget:g}: planned {amounts}", True
    return (f"memory_budget {config.memory_budget:g} not met: planned {amounts} with every quantizable tensor at "
            "2 bits; the rest are kept exact or hold their roles' plans (loss input, x @ A, outputs)"), False
