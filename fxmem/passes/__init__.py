"""Graph rewrites, one file per pass family, run in order by the pass manager (fxmem.techniques declares the
order and which technique enables each)."""

from fxmem.passes.dynamo.causal_mask import CausalMaskAttention
from fxmem.passes.dynamo.chunk_linears import ChunkLinears
from fxmem.passes.dynamo.chunk_loss import ChunkLoss
from fxmem.passes.dynamo.chunk_mlp import ChunkMlp
from fxmem.passes.dynamo.chunk_norm import ChunkNorm
from fxmem.passes.dynamo.dequantize_bases import DequantizeBases
from fxmem.passes.dynamo.gqa_attention import GqaAttention
from fxmem.passes.joint.adapter_cast import RecomputeAdapterCast
from fxmem.passes.joint.checkpoint_blocks import CheckpointBlocks
from fxmem.passes.joint.lora_reorder import LoraReorder
from fxmem.passes.joint.merge_casts import MergeCasts
from fxmem.passes.joint.recompute_attention import RecomputeAttention
from fxmem.passes.joint.recompute_inputs import RecomputeInputs
from fxmem.passes.joint.recompute_logits import RecomputeLogits
from fxmem.passes.joint.replay_dropout import ReplayDropout
from fxmem.passes.joint.runlora import RunLora
from fxmem.passes.manager import GraphPass, PassManager, PassRecord, PassResult, PipelineState
from fxmem.passes.partitioned.fuse_epilogue import FuseEpilogue
from fxmem.passes.partitioned.lora_half_products import LoraHalfProducts
from fxmem.passes.partitioned.lowrank import LowRankSaved
from fxmem.passes.partitioned.offload_blocks import OffloadBlocks
from fxmem.passes.partitioned.onednn_matmul import OnednnMatmul
from fxmem.passes.partitioned.quantize import QuantizeSaved
from fxmem.passes.partitioned.sparsify import SparsifyAttention

__all__ = ["CausalMaskAttention", "CheckpointBlocks", "ChunkLinears", "ChunkLoss", "ChunkMlp", "ChunkNorm",
           "DequantizeBases", "FuseEpilogue", "GqaAttention", "GraphPass", "LoraHalfProducts", "LoraReorder",
           "LowRankSaved", "MergeCasts", "OffloadBlocks", "OnednnMatmul", "PassManager", "PassRecord", "PassResult",
           "PipelineState", "QuantizeSaved", "RecomputeAdapterCast", "RecomputeAttention", "RecomputeInputs",
           "RecomputeLogits", "ReplayDropout", "RunLora", "SparsifyAttention"]
