"""What one saved storage can become: each technique's proposal (quantized, low rank, sparse, recomputed, replayed,
rebuilt from a norm's output, waiting in host memory), priced by the cost model, and the constants that bound them."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.analysis import Analysis, Role, SavedTensor
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
from fxmem.analysis.ops import CHUNKED_MLP, CHUNKED_NORM
from fxmem.analysis.recompute import rebuild_inputs, replays_product
from fxmem.analysis.roles import from_softmax
from fxmem.analysis.rope import Replay
from fxmem.config import BITS_CHOICES, Config
from fxmem.cost_model.memory import lowrank_bytes, prenorm_bytes, quantized_bytes, sparse_bytes, stored_bytes
from fxmem.cost_model.plan import Action, Keep, LowRank, Plan, Quantize, RebuildNormInput, Recompute, Sparsify
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
# QUANTIZED_ROLES: its backward needs it consistent with q, k, v; see passes/joint/recompute_attention.py.)
EXACT_ROLES = frozenset({Role.LORA_INTERMEDIATE, Role.LOSS_INPUT, Role.LOSS_GRADIENT, Role.ROUTER})
# Roles LoRAct stores as low-rank factors: their backward needs only the value. Attention's q, k, v too: fused
# attention is then recomputed in backward from the rebuilt values (passes/joint/recompute_attention.py), q and k
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


def rebuild_refusal(consumer: str, config: Config) -> str | None:
    """Why lora_reorder should leave a LoRA output feeding ``consumer`` as is, or None to rebuild it.
    ``config`` has ``bits`` (Config refuses lora_reorder without them). With ``rebuild_from_x`` (not counted on
    under memory_budget, whose plan replays an X W only where that is its cheapest move) the X W is replayed from x
    at REBUILD_SOURCE_BITS, or else stored at that width (configured_bits): never rounded coarser."""
    if consumer in DERIVATIVE_SAVED_ACTIVATIONS and config.bits < REBUILD_ALL_ACTIVATIONS_BITS \
            and not (config.rebuild_from_x and config.memory_budget is None):
        return (f"feeding {consumer} left as is: at {config.bits} bits the saved {consumer} derivative is more "
                "faithful than a rebuilt input")
    return None


# A technique's planner hook (fxmem.techniques registers it): ``propose`` the compression the config asks of one
# storage (None where the technique does not apply; it may add the RoPE tables the plan pays for to the set it is
# given). The choice among them and every other option is the planner's (fit_ceilings, fit_budget).
Propose = Callable[[SavedTensor, list[SavedTensor], Analysis, Config, set[str]], Plan | None]


def held_as_is(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis) -> Plan | None:
    """The plan of a storage no technique may compress, or None."""
    if not owner.frees_memory:
        return Keep("frees nothing: not an activation")
    if owner.storage in analysis.output_storages:
        if any(s.feeds_attention in ("k", "v") for s in group):
            return Keep("also a forward output, the caller holds it anyway: a KV cache (use_cache=False "
                        "in training frees it)")
        return Keep("also a forward output: the caller holds it anyway")
    exact = sorted({r.value for s in group for r in (s.role, *s.also) if r in EXACT_ROLES})
    if exact:
        return Keep(f"kept exact: {', '.join(exact)}")
    return None


def propose_quantized(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                      tables: set[str]) -> Plan | None:
    """``bits``: HyC-LoRA's per-channel quantization, for the roles it stores quantized."""
    if config.bits is None or not all(s.role in QUANTIZED_ROLES for s in group):  # None: demoted off (less_lossy)
        return None
    if not quantizable(group, config):  # intra=False: the paper's inter-only ablation row
        return Keep("intra-operator quantization off (intra=False)")
    bits = configured_bits(owner, config)
    if owner.storage in analysis.rebuild_sources and bits < REBUILD_SOURCE_BITS:
        return rebuild_source(owner, group, analysis, config, tables, _rebuilt_from(owner))
    return quantized_plan(owner, group, analysis, config, tables, bits)


def _rebuilt_from(owner: SavedTensor) -> str:
    """What backward rebuilds from a rebuild source (analysis/saved.py says which storages are)."""
    if BLOCK_SOURCE in owner.base.meta:
        return f"block {owner.base.meta[BLOCK_SOURCE]}"
    return {CHUNKED_MLP: "the chunked MLP's gate and up products",
            CHUNKED_NORM: "the chunked RMSNorm's output"}.get(owner.chunked_reader, "an X W")


def propose_lowrank(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                    tables: set[str]) -> Plan | None:
    """``lowrank``: LoRAct's low-rank factors, for the roles whose backward needs only the value."""
    if config.lowrank is None:  # demoted off (less_lossy)
        return None
    if not all(s.role in LOWRANK_ROLES for s in group) or owner.storage in analysis.rebuild_sources:
        return None  # an x that an X W is replayed from stays quantized at REBUILD_SOURCE_BITS
    # q, k and v quantized at qkv_bits are protected from the softmax's amplification of their error: not factored
    if (config.bits is not None and config.qkv_bits is not None and quantizable(group, config)
            and any(map(_attention_input, group))):
        return None
    return _lowrank(owner, analysis, config.lowrank, tables)


def propose_sparse(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                   tables: set[str]) -> Plan | None:
    """``attn_sparsity``: eager attention's probabilities pruned per row."""
    if config.attn_sparsity is not None and owner.role is Role.ATTN_PROBS and from_softmax(owner.base):
        return _sparsify(owner, config.attn_sparsity)
    return None


def recompute_plan(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]],
                    owner_plans: dict[str, Plan]) -> Plan | None:
    """Recomputing ``owner``'s storage in backward from the saved storages and graph inputs its chain reads, if it is
    compressible (the callers keep what it reads saved); priced by reading them once more as they are planned, or,
    where it replays the experts' products, by running its chain again (their flops)."""
    if owner.recompute is None or not _compressible(by_storage[owner.storage]):
        return None
    leaves = [n.name for n in rebuild_inputs(owner.recompute) if n.name in by_storage]
    device = str(tensor_val(owner.base).device)
    if replays_product(owner.recompute):  # the experts' products run again: their flops
        return Recompute(f"rebuilt in backward by the experts' products from {', '.join(leaves)}",
                         nbytes=0, seconds=forward_seconds(owner.recompute, device), chain=owner.recompute)
    read = sum(stored_bytes(by_storage[leaf][0], owner_plans[leaf]) for leaf in leaves)
    return Recompute(f"rebuilt element-wise in backward from {', '.join(leaves) or 'graph inputs'}",
                     nbytes=0, seconds=recompute_seconds(read, device), chain=owner.recompute)


def _compressible(group: list[SavedTensor]) -> bool:
    return all(s.role in QUANTIZED_ROLES | LOWRANK_ROLES for s in group)


def quantizable(group: list[SavedTensor], config: Config) -> bool:
    """Every tensor of the storage has a role quantization may store; intra=False allows only what lora_reorder
    saves (x W), the paper's inter-only ablation row."""
    return all(s.role in QUANTIZED_ROLES for s in group) and (
        config.intra or all(s.role is Role.LORA_BASE_OUTPUT for s in group))


def configured_bits(owner: SavedTensor, config: Config) -> int:
    if lowest_bits(owner) > config.bits:
        return lowest_bits(owner)  # rebuild_refusal's width, unless replayed from x
    if config.qkv_bits is not None and (owner.feeds_attention or owner.reaches_attention) is not None:
        return config.qkv_bits
    if config.linear_input_bits is not None and Role.LINEAR_INPUT in (owner.role, *owner.also):
        return max(config.bits, config.linear_input_bits)
    return config.bits


def quantized_plan(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
              tables_saved: set[str], bits: int) -> Plan:
    node, replay, tables_bytes, replay_reason = _replay_source(owner, analysis, tables_saved)
    reason = f"{bits}-bit per channel{replay_reason}"
    val = tensor_val(node)
    refused = _refused_layout(val, "channels", "channel layout to quantize")
    if refused is not None:
        return refused
    order = memory_order(val)
    if not isinstance(val.shape[order[-1]], int):
        return Keep("symbolic channel dimension: scales need a fixed channel count")
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
        return Keep(f"quantizing would not shrink it ({nbytes} >= {owner.nbytes} bytes)")
    seconds = quantize_seconds(numel_hint(val), val.element_size(), bits, chunk, str(val.device), rotation=rotation,
                               stochastic=config.stochastic_rounding)
    return Quantize(reason, bits=bits, channels=channels, merged=merged if merged > 1 else 0,
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
        return Keep(f"not a floating tensor with rows and {inner}")
    if memory_order(val) is None:
        return Keep(f"not dense in memory: no {layout}")
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
        return Keep("attention probabilities with a symbolic or strided layout are kept")
    row = val.shape[-1]
    keep = max(1, math.ceil(ratio * row))
    nbytes = sparse_bytes(numel_hint(val), row, keep, val.element_size())
    return Sparsify(f"largest {keep} of {row} per row kept (attn_sparsity: the probability mass each row "
                    "drops is not bounded)", kept_per_row=keep, nbytes=nbytes,
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
        return Keep("symbolic last dimension: the rank is a fixed share of it")
    if owner.role is Role.ATTN_QKV and width <= hint(tensor_val(owner.node).shape[-1]):
        # A per-head layout (GPT-2's per-head copies; MQA's single k/v head): factors of one head's width
        # share one small subspace across all heads, far worse than factors of a projection's output, which
        # spans several heads (wider than the saved tensor's last dimension).
        return Keep(f"per-head layout ({numel_hint(val) // width} x {width}): q, k, v are factored only as "
                    "their projection's output")
    k = resolve_rank(rank, (width, width))  # from the last dimension alone: the row count may be symbolic
    rows = numel_hint(val) // width
    nbytes = lowrank_bytes((rows, width), k, val.element_size()) + tables_bytes
    if nbytes >= owner.nbytes:
        return Keep(f"rank-{k} factors would not shrink it ({nbytes} >= {owner.nbytes} bytes)")
    return LowRank(f"rank {k} of {width}, as {rows} x {width}{replay_reason}", rank=k, replay=replay,
                   nbytes=nbytes, seconds=lowrank_seconds(rows, width, k, DEFAULT_NITER, str(val.device)))


def rebuilds_from_x(config: Config) -> bool:
    """``rebuild_from_x`` with the lora_reorder that saves X W (a preset's, turned off, leaves it set)."""
    return config.rebuild_from_x and config.lora_reorder


def stored_as(plan: Plan) -> str:
    """What a quantize or lowrank plan stores, for a reason."""
    if isinstance(plan, LowRank):
        return f"rank-{plan.rank} factors"
    return f"{plan.bits}-bit codes" if isinstance(plan, Quantize) else plan.action.value


def prenorm_plan(owner: SavedTensor, analysis: Analysis, output: str, output_plan: Plan) -> Plan:
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
    factored = isinstance(output_plan, LowRank)
    return RebuildNormInput(f"rebuilt as {formula} from {output}'s {stored_as(output_plan)}; {exact} smallest-|gamma| "
                            f"channel{'s' if exact > 1 else ''} exact", bits=None if factored else output_plan.bits,
                            rank=output_plan.rank if factored else 0, exact_channels=exact, norm=unit, nbytes=nbytes,
                            seconds=seconds)


def source_bits(owner: SavedTensor, config: Config) -> int:
    """The fewest bits of a storage backward rebuilds something from: a checkpointed block's input at
    Config.block_input_bits where set, else REBUILD_SOURCE_BITS (as rebuild_source plans it)."""
    return block_source_bits(config) if BLOCK_SOURCE in owner.base.meta else REBUILD_SOURCE_BITS


def block_source_bits(config: Config) -> int:
    return config.block_input_bits if config.block_input_bits is not None else REBUILD_SOURCE_BITS


def replay_source_storage(owner: SavedTensor, by_storage: dict[str, list[SavedTensor]]) -> str | None:
    """The one saved storage an X W's matmul replays from (its x; the weight frees nothing), or None."""
    if owner.rebuild_product is None:
        return None
    leaves = [n.name for n in rebuild_inputs(owner.rebuild_product)
              if n.name in by_storage and by_storage[n.name][0].frees_memory]
    return leaves[0] if len(leaves) == 1 else None


def replayed_plan(owner: SavedTensor, source: str) -> Plan:
    """An X W rebuilt in backward by replaying its matmul from ``source`` (its x), priced by the matmul's flops."""
    product = owner.rebuild_product[-1]
    out = tensor_val(product)  # 2-d from mm, or (batch, tokens, out) from an NF4 gemm
    rows, cols = numel_hint(out) // hint(out.shape[-1]), hint(out.shape[-1])
    inner = hint(tensor_val(matmul_operands(product)[0]).shape[-1])
    seconds = product_seconds(rows, inner, cols, str(out.device))
    return Recompute(f"rebuilt in backward as x W^T from {source} and the frozen weight: a matmul, "
                     f"{seconds * 1e3:.3g} ms", nbytes=0, seconds=seconds, chain=owner.rebuild_product)


# What passes/partitioned/offload_blocks.py moves: the tensor itself, or the tensors compress_storage saved in its place.
_OFFLOADABLE = (Action.KEEP, Action.QUANTIZE, Action.LOWRANK)


def offloadable(owner: SavedTensor, group: list[SavedTensor], plan: Plan, analysis: Analysis) -> bool:
    """Whether a checkpointed block's input, planned ``plan``, can wait in host memory (block_offload)."""
    # kept exact, the storage moves only where it is saved once, as itself (a saved view would hold it here)
    kept_whole = plan.action is not Action.KEEP or (len(group) == 1 and owner.node is owner.base)
    return BLOCK_SOURCE in owner.base.meta and owner.frees_memory and owner.storage not in analysis.output_storages \
        and plan.action in _OFFLOADABLE and kept_whole and not plan.host


def offloaded(owner: SavedTensor, plan: Plan) -> Plan:
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


def rebuild_source(owner: SavedTensor, group: list[SavedTensor], analysis: Analysis, config: Config,
                    tables: set[str], purpose: str) -> Plan:
    """The plan of an x that backward rebuilds another tensor from (``purpose`` names it): REBUILD_SOURCE_BITS, or
    a checkpointed block's input at Config.block_input_bits."""
    plan = quantized_plan(owner, group, analysis, config, tables, source_bits(owner, config))
    if plan.action is not Action.QUANTIZE:
        return plan
    return dataclasses.replace(plan, reason=f"{plan.reason}; {purpose} rebuilt from it in backward")


def lowest_bits(owner: SavedTensor) -> int:
    """An X W that lora_reorder rebuilds a GELU, tanh or ReLU input from stays at the width that decision assumed
    (rebuild_refusal), unless rebuild_from_x replays it."""
    if owner.role is Role.LORA_BASE_OUTPUT and owner.rebuilt_for in DERIVATIVE_SAVED_ACTIVATIONS:
        return REBUILD_ALL_ACTIVATIONS_BITS
    if owner.role is Role.ROW_SCALED:
        return ROW_SCALED_BITS
    return min(BITS_CHOICES)
