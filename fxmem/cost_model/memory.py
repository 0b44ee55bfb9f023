"""Bytes a saved tensor takes under a plan, what fxmem's own ops hold inside, and the memory traffic a fused
LoRA epilogue avoids."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch.fx import Node

from fxmem.analysis.graph import hint
from fxmem.cost_model.loss import LossChunks, chunked_loss_bytes
from fxmem.cost_model.plan import Action
from fxmem.kernels import chunked_lora_linear, chunked_mlp, chunked_rms_norm
from fxmem.kernels.lowrank import factor_numel
from fxmem.kernels.quantize import packed_width

if TYPE_CHECKING:
    from fxmem.analysis import SavedRecord
    from fxmem.cost_model.plan import Plan

SCALE_BYTES = 4  # per-channel scale and zero point are float32
CHANNEL_ID_BYTES = 8  # outlier channel ids are int64
CHUNK_INDEX_BYTES = 1  # an outlier value's index in its chunk


def quantized_bytes(numel: int, channels: int, bits: int, outliers: int, element_size: int, chunk: int = 0) -> int:
    """Packed codes, row by row + full-precision outlier columns + per-channel scale and zero + outlier ids + per
    row, one exact value and its index for each chunk of ``chunk`` channels (fxmem.kernels.quantize)."""
    rows = numel // channels
    chunks = -(-channels // chunk) if chunk else 0
    return (rows * packed_width(channels, bits) + rows * outliers * element_size + 2 * channels * SCALE_BYTES
            + outliers * CHANNEL_ID_BYTES + rows * chunks * (element_size + CHUNK_INDEX_BYTES))


def sparse_index_bytes(row_length: int) -> int:
    """Bytes of one column index of a pruned row: int16 while the row fits, else int32."""
    return 2 if row_length <= 2**15 else 4


def sparse_bytes(numel: int, row_length: int, keep: int, element_size: int) -> int:
    """The ``keep`` largest values of every row and their column indices."""
    rows = numel // row_length
    return rows * keep * (element_size + sparse_index_bytes(row_length))


def lowrank_bytes(shape: tuple[int, ...], rank: int, element_size: int) -> int:
    """Factors U (*, m, rank) and V (*, rank, n) of a (*, m, n) tensor, kept in the tensor's dtype.

    ``rank`` is the resolved integer (``fxmem.kernels.lowrank.resolve_rank``). The shape is the one the pass
    decomposes: a (batch, seq, hidden) activation flattened to (batch * seq, hidden) costs (batch * seq + hidden)
    * rank values, a batch of matrices pays the hidden side once per matrix.
    """
    return factor_numel(shape, rank) * element_size


def prenorm_bytes(rows: int, exact_channels: int, element_size: int) -> int:
    """A norm input rebuilt from its output (as factors or codes): the exactly saved input channels and their ids.

    The output's factors or codes are priced on the output; the per-row rstd is priced where the backward did not
    save it already."""
    return rows * exact_channels * element_size + exact_channels * CHANNEL_ID_BYTES


def planned_bytes(saved: SavedRecord, plan: Plan) -> int:
    """Device bytes held between forward and backward once ``plan`` is applied to ``saved``: none for what waits
    in host memory (``host_bytes``)."""
    return 0 if plan.host else stored_bytes(saved, plan)


def host_bytes(saved: SavedRecord, plan: Plan) -> int:
    """Host-memory bytes held between forward and backward once ``plan`` is applied to ``saved``."""
    return stored_bytes(saved, plan) if plan.host else 0


def stored_bytes(saved: SavedRecord, plan: Plan) -> int:
    """Bytes ``plan`` stores for ``saved`` between forward and backward, on the device or the host."""
    if plan.action is Action.KEEP or saved.nbytes == 0:  # a view shares its owner's (already counted) storage
        return saved.nbytes
    if plan.nbytes is None:
        raise ValueError(f"plan {plan.action.value!r} for {saved.name} carries no byte count")
    return plan.nbytes


def epilogue_traffic_saved(numel: int, element_size: int, lora_sums: int, *, backward: bool) -> int:
    """Memory traffic a fused LoRA epilogue (fxmem/kernels/lora_epilogue.py, Triton) avoids.

    Unfused, each LoRA sum base + s (X A^T) B^T writes its (X A^T) B^T product and reads it back, and in backward
    also its dequantized base; the fused kernel computes both tile by tile in registers. The packed codes, X A^T, B,
    the incoming gradient and the outputs move the same bytes either way.
    """
    return lora_sums * numel * element_size * (4 if backward else 2)


# op name: is backward
_CHUNKED_MLP_OPS = {"chunked_swiglu_mlp": False, "chunked_swiglu_mlp_backward": True}
_CHUNKED_NORM_OPS = {"chunked_rms_norm": False, "chunked_rms_norm_backward": True}
_CHUNKED_LINEARS_OPS = {"chunked_lora_linears": False, "chunked_lora_linears_backward": True}


def op_workspace_bytes(node: Node) -> int:
    """What the op of an aten graph's ``node`` holds inside, beyond its inputs and outputs: one chunk's MLP-wide
    tensors for the chunked MLP (kernels/chunked_mlp.py), one chunk's float32 rows for the chunked RMSNorm
    (kernels/chunked_rms_norm.py) and the chunked LoRA linears (kernels/chunked_lora_linear.py), one chunk's
    logits for the chunked loss; 0 for the ops a graph's liveness sees whole."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "fxmem":
        return 0
    if target._opname == "linear_cross_entropy":
        x, weight = (node.args[i].meta["val"] for i in (0, 1))
        tokens, hidden = (hint(s) for s in x.shape)  # a dynamic length's hint: int() would guard on it
        gradient = tokens * hidden * x.element_size()
        chunks = LossChunks(min(tokens, int(node.args[8])), int(node.args[9]) or None)
        return chunked_loss_bytes(tokens, hint(weight.shape[0]), hidden, x.element_size(), chunks) - gradient
    if target._opname in _CHUNKED_NORM_OPS:
        backward = _CHUNKED_NORM_OPS[target._opname]
        x = node.args[backward].meta["val"]
        rows = math.prod(hint(s) for s in x.shape[:-1])
        return chunked_rms_norm.workspace_bytes(rows, int(node.args[3 + backward]), hint(x.shape[-1]),
                                                x.element_size(), backward=backward)
    if target._opname in _CHUNKED_LINEARS_OPS:
        backward = _CHUNKED_LINEARS_OPS[target._opname]
        x, weights, a = (node.args[i + backward] for i in (0, 1, 2))
        x = x.meta["val"]
        rows = math.prod(hint(s) for s in x.shape[:-1])
        return chunked_lora_linear.workspace_bytes(
            rows, int(node.args[5 + backward]), hint(x.shape[-1]), [hint(w.meta["val"].shape[0]) for w in weights],
            max(hint(t.meta["val"].shape[0]) for t in a), x.element_size(), backward=backward,
            x_trains=bool(node.args[7]) if backward else True)
    if target._opname not in _CHUNKED_MLP_OPS:
        return 0
    backward = _CHUNKED_MLP_OPS[target._opname]
    x, down_w = (node.args[i + backward].meta["val"] for i in (0, 9))
    rows = math.prod(hint(s) for s in x.shape[:-1])
    return chunked_mlp.workspace_bytes(rows, int(node.args[13 + backward]), hint(down_w.shape[1]),
                                       x.element_size(), backward=backward)
