"""Graph rewrites, one file per pass family, run in order by the pass manager (fxmem.techniques declares the
order and which technique enables each)."""

from fxmem.passes.adapter_cast import RecomputeAdapterCast
from fxmem.passes.causal_mask import CausalMaskAttention
from fxmem.passes.checkpoint_blocks import CheckpointBlocks
from fxmem.passes.chunk_linears import ChunkLinears
from fxmem.passes.chunk_loss import ChunkLoss
from fxmem.passes.chunk_mlp import ChunkMlp
from fxmem.passes.chunk_norm import ChunkNorm
from fxmem.passes.dequantize_bases import DequantizeBases
from fxmem.passes.fuse_epilogue import FuseEpilogue
from fxmem.passes.gqa_attention import GqaAttention
from fxmem.passes.lora_half_products import LoraHalfProducts
from fxmem.passes.lora_reorder import LoraReorder
from fxmem.passes.lowrank import LowRankSaved
from fxmem.passes.manager import GraphPass, PassManager, PassRecord, PassResult, PipelineState
from fxmem.passes.merge_casts import MergeCasts
from fxmem.passes.offload_blocks import OffloadBlocks
from fxmem.passes.onednn_matmul import OnednnMatmul
from fxmem.passes.quantize import QuantizeSaved
from fxmem.passes.recompute_attention import RecomputeAttention
from fxmem.passes.recompute_inputs import RecomputeInputs
from fxmem.passes.recompute_logits import RecomputeLogits
from fxmem.passes.replay_dropout import ReplayDropout
from fxmem.passes.runlora import RunLora
from fxmem.passes.sparsify import SparsifyAttention

__all__ = ["CausalMaskAttention", "CheckpointBlocks", "ChunkLinears", "ChunkLoss", "ChunkMlp", "ChunkNorm",
           "DequantizeBases", "FuseEpilogue", "GqaAttention", "GraphPass", "LoraHalfProducts", "LoraReorder",
           "LowRankSaved", "MergeCasts", "OffloadBlocks", "OnednnMatmul", "PassManager", "PassRecord", "PassResult",
           "PipelineState", "QuantizeSaved", "RecomputeAdapterCast", "RecomputeAttention", "RecomputeInputs",
           "RecomputeLogits", "ReplayDropout", "RunLora", "SparsifyAttention"]
