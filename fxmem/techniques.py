"""Every technique as one registered unit: its section of ``Config``, its planner hook and its passes.

Adding a technique means a Config section (fields, validation, presets), a planner hook in cost_model/options.py,
a pass in its stage's folder of passes/ (named in that stage's ``ORDER``), and one ``Technique`` here. ``PASS_ORDER``
is the stages' orders, one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fxmem.config import Config
from fxmem.cost_model import options
from fxmem.passes import (
    CausalMaskAttention,
    CheckpointBlocks,
    ChunkLinears,
    ChunkLoss,
    ChunkMlp,
    ChunkNorm,
    DequantizeBases,
    FuseEpilogue,
    GqaAttention,
    GraphPass,
    LoraHalfProducts,
    LoraReorder,
    LowRankSaved,
    MergeCasts,
    OffloadBlocks,
    OnednnMatmul,
    QuantizeSaved,
    RecomputeAdapterCast,
    RecomputeAttention,
    RecomputeInputs,
    RecomputeLogits,
    ReplayDropout,
    RunLora,
    SparsifyAttention,
    dynamo,
    joint,
    partitioned,
)


@dataclass(frozen=True)
class Technique:
    name: str
    fields: tuple[str, ...]  # its section of Config
    enabled: Callable[[Config], bool]
    passes: tuple[str, ...] = ()  # the passes it needs, by name (PASS_ORDER orders them; shared ones run once)
    propose: options.Propose | None = None  # the compression the config asks of one saved storage


# Quantization and low-rank factors both recompute the logits and fused attention, so that those are not saved
# exact beside the compressed tensors (passes/joint/recompute_logits.py, passes/joint/recompute_attention.py).
_COMPRESSION_RECOMPUTES = ("recompute_logits", "recompute_attention")

# Where two proposals save as many bytes, the earlier-registered technique's is the configured compression.
TECHNIQUES: tuple[Technique, ...] = (
    Technique("quantize", ("bits", "qkv_bits", "linear_input_bits", "outlier_ratio", "outlier_values", "rotation",
                           "stochastic_rounding", "calibration_steps", "calibration", "intra"),
              lambda config: config.bits is not None, (*_COMPRESSION_RECOMPUTES, "quantize"),
              propose=options.propose_quantized),
    Technique("lowrank", ("lowrank", "prenorm_sharing"), lambda config: config.lowrank is not None,
              (*_COMPRESSION_RECOMPUTES, "lowrank"), propose=options.propose_lowrank),
    Technique("attn_sparsity", ("attn_sparsity",), lambda config: config.attn_sparsity is not None,
              ("sparsify_attention",), propose=options.propose_sparse),
    Technique("lora_reorder", ("lora_reorder", "rebuild_from_x", "fused_epilogue"),
              lambda config: config.lora_reorder, ("lora_reorder", "fuse_epilogue")),
    Technique("runlora", ("runlora",), lambda config: config.runlora != "off", ("runlora", "onednn_matmul")),
    # PEFT's fp32 adapters on a half-precision model: the cast of x recomputed in backward, in every preset (the
    # cast is lossless, though inductor then sums in another order: under exact the gradients are torch.compile's
    # within bf16 rounding, tests/test_exact.py); x saved where a lossy plan follows.
    Technique("adapter_cast", (), lambda config: True, ("recompute_adapter_cast",)),
    # A LoRA input's dropout mask drawn again in backward from its seed, in every preset: the same mask, so under
    # exact the gradients are torch.compile's.
    Technique("replay_dropout", (), lambda config: True, ("replay_dropout",)),
    # Duplicate casts of one value (autocast casts x once per op that reads it) merged before the LoRA matcher runs,
    # in every preset: min-cut would merge them after the joint passes; nothing changes value.
    Technique("merge_casts", (), lambda config: True, ("merge_casts",)),
    # What forward builds from the graph's inputs alone (autocast's bf16 weight copies, a packed batch's attention
    # mask) recomputed in backward, in every preset: exact.
    Technique("recompute_inputs", (), lambda config: True, ("recompute_inputs",)),
    # A mask proven causal becomes SDPA's is_causal in every preset: exact, and the tokens x tokens mask is gone.
    Technique("causal_mask", (), lambda config: True, ("causal_mask",)),
    # Then a GQA model's key and value heads are read once with SDPA's enable_gqa, not repeated for it, in every
    # preset: exact.
    Technique("gqa_attention", (), lambda config: True, ("gqa_attention",)),
    Technique("chunk_loss", ("chunk_loss", "return_logits"), lambda config: config.chunk_loss, ("chunk_loss",)),
    # The chunked MLP and linears read a float base weight: a bitsandbytes 4-bit one is dequantized for them, and
    # again in backward (passes/dynamo/dequantize_bases.py).
    Technique("chunk_mlp", ("mlp_chunk",), lambda config: config.mlp_chunk is not None,
              ("dequantize_bases", "chunk_mlp")),
    Technique("chunk_norm", ("norm_chunk",), lambda config: config.norm_chunk is not None, ("chunk_norm",)),
    Technique("chunk_linears", ("linear_chunk",), lambda config: config.linear_chunk is not None,
              ("dequantize_bases", "chunk_linears")),
    Technique("block_checkpoint", ("block_checkpoint", "block_input_bits"), lambda config: config.block_checkpoint,
              ("checkpoint_blocks",)),
    # PEFT's fp32 adapters on a half-precision model: their products with half-precision inputs (tensor cores).
    Technique("lora_half_products", ("lora_half_products",), lambda config: config.lora_half_products != "off",
              ("lora_half_products",)),
    Technique("memory_budget", ("memory_budget",), lambda config: config.memory_budget is not None,
              (*_COMPRESSION_RECOMPUTES, "quantize")),
    Technique("block_offload", ("block_offload",), lambda config: config.block_offload, ("offload_blocks",)),
)

# Config fields that belong to no technique: how fxmem checks its plan on the batch (fxmem/guard.py), and reports
# what it could not do (fxmem/fallback.py).
GENERAL_FIELDS = ("guard", "guard_cosine", "guard_every", "strict")

PASSES: dict[str, type[GraphPass]] = {p.name: p for p in (
    CausalMaskAttention, CheckpointBlocks, ChunkLinears, ChunkLoss, ChunkMlp, ChunkNorm, DequantizeBases, GqaAttention,
    MergeCasts, RecomputeAdapterCast, ReplayDropout, RecomputeInputs, LoraReorder, RunLora, RecomputeLogits,
    RecomputeAttention, SparsifyAttention, QuantizeSaved, LowRankSaved, FuseEpilogue, OffloadBlocks, LoraHalfProducts,
    OnednnMatmul)}
# Each stage owns its passes' order (fxmem/passes/<stage>/__init__.py); the stages run in the pipeline's order.
PASS_ORDER = dynamo.ORDER + joint.ORDER + partitioned.ORDER


# A pass runs when one of the techniques it serves is on, wherever it is built.
for _name, _pass in PASSES.items():
    _pass.techniques = tuple(t for t in TECHNIQUES if _name in t.passes)


def enabled_techniques(config: Config) -> list[Technique]:
    """The techniques ``config`` turns on, in registration order."""
    return [t for t in TECHNIQUES if t.enabled(config)]


def default_passes() -> list[GraphPass]:
    """Every pass of every technique, in ``PASS_ORDER``."""
    return [PASSES[name]() for name in PASS_ORDER]
