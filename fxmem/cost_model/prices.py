"""Seconds a plan adds to a step: what the planner weighs against the bytes the plan saves.

Compressing and decompressing are memory-bound (fxmem/kernels/quantize.py's formulas, fused by inductor into
the kernels around them): priced by the bytes they move, at the device's memory bandwidth, measured once per
process. A free recomputation (fxmem/analysis/recompute.py) replays element-wise ops fused into whatever reads
the tensor in backward: priced by the bytes of its inputs read once more. Low-rank factors, and a LoRA linear's
frozen product replayed in backward, are priced by their flops at the device's measured matmul rate.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence

import torch
from torch.fx import Node
from torch.utils._python_dispatch import _disable_current_modes

from fxmem.analysis.graph import hint, is_view, numel_hint, schema_name, tensor_val
from fxmem.analysis.lora import MATMULS, is_linear_product, matmul_operands
from fxmem.analysis.ops import BATCHED_MATMULS, GROUPED_LORA, is_fused_attention, op_argument
from fxmem.analysis.recompute import is_grouped_product
from fxmem.kernels.quantize import fit_reads
from fxmem.timing import median, step_times

_PROBE_BYTES = 2**26  # a 64 MiB copy: past the caches, a few milliseconds
_PROBE_SIZE = 1024  # a square matmul for the flops rate


@functools.cache
def memory_bandwidth(device: str = "cpu") -> float:
    """Bytes a second a large copy moves on ``device`` (read and written), measured once per process."""
    with _disable_current_modes(), torch.no_grad():
        source = torch.empty(_PROBE_BYTES // 4, device=device)
        target = torch.empty_like(source)
        seconds = median(step_times(lambda: target.copy_(source), steps=5, warmup=1, device=device))
    return 2 * _PROBE_BYTES / max(seconds, 1e-9)


@functools.cache
def matmul_rate(device: str = "cpu") -> float:
    """fp32 flops a second of a square matmul on ``device``, measured once per process."""
    with _disable_current_modes(), torch.no_grad():
        a = torch.randn(_PROBE_SIZE, _PROBE_SIZE, device=device)
        seconds = median(step_times(lambda: a @ a, steps=3, warmup=1, device=device))
    return 2 * _PROBE_SIZE**3 / max(seconds, 1e-9)


def quantize_seconds(numel: int, element_size: int, bits: int, chunk: int, device: str = "cpu", *, rotation: int = 0,
                     stochastic: bool = False) -> float:
    """Forward: the statistics read the tensor, the codes read it again (the outlier values once more, a fitted
    range its sampled rows) and write the packed bytes; backward: the consumer reads the packed bytes, which is
    no more than it read before. A rotation adds two products of each row by a (rotation x rotation) matrix, one
    each way, and the rotated copy written and read in float32; stochastic rounding a float32 random number per
    value, priced as one written and read."""
    traffic = numel * ((2 + (1 if chunk else 0) + fit_reads(bits)) * element_size + bits / 8)
    if rotation:
        traffic += 2 * 4 * numel
    if stochastic:
        traffic += 2 * 4 * numel
    seconds = traffic / memory_bandwidth(device)
    return seconds + (2 * 2 * rotation * numel / matmul_rate(device) if rotation else 0.0)


def recompute_seconds(input_bytes: int, device: str = "cpu") -> float:
    """A free recomputation: its inputs read once more in backward."""
    return input_bytes / memory_bandwidth(device)


# A GPU's link to host memory, each way: a PCIe 5 x16 link moves about 50 GB/s of its 64 (torch's own
# activation offloading assumes the same, torch._functorch.config.activation_offload_cpu_gpu_bw).
HOST_LINK_BANDWIDTH = 50e9


def offload_seconds(nbytes: int, device: str = "cpu") -> float:
    """A tensor copied to host memory and back: over the host link, or on a CPU two copies in its memory."""
    if device.startswith("cpu"):
        return 2 * 2 * nbytes / memory_bandwidth(device)  # two copies, each reading and writing it
    return 2 * nbytes / HOST_LINK_BANDWIDTH


def attention_seconds(batch: int, heads: int, queries: int, keys: int, head_dim: int, *, causal: bool,
                      device: str = "cpu") -> float:
    """One attention forward (QK^T and PV: 4 x batch x heads x queries x keys x head_dim flops, half of them under a
    causal mask) at the device's measured fp32 matmul rate: an upper bound where fused attention runs in bf16."""
    return _attention_flops(batch, heads, queries, keys, head_dim, causal) / matmul_rate(device)


def _attention_flops(batch: int, heads: int, queries: int, keys: int, head_dim: int, causal: bool) -> int:
    return 4 * batch * heads * queries * keys * head_dim // (2 if causal else 1)


def attention_op_seconds(node: Node) -> float:
    """One forward of a fused attention op at the measured matmul rate."""
    query = tensor_val(node.args[0])
    return attention_flops(node) / matmul_rate(query.device.type) if query is not None else 0.0


def attention_flops(node: Node) -> int:
    """A fused attention op's flops (attention_seconds), from its query's and key's (batch, heads, length,
    head_dim) shapes."""
    query, key = (tensor_val(n) for n in node.args[:2])
    if query is None or key is None or query.dim() != 4 or key.dim() != 4:
        return 0
    batch, heads, queries, head_dim = (hint(size) for size in query.shape)
    return _attention_flops(batch, heads, queries, hint(key.shape[2]), head_dim,
                            op_argument(node, "is_causal", False) is True)


def forward_seconds(nodes: Sequence[Node], device: str = "cpu") -> float:
    """``nodes`` (a forward) run again in backward: matmuls (a 4-bit base's products too) and fused attention by
    their flops at the measured matmul rate; a custom op that reads parameter matrices (fxmem's chunked MLP and
    linears) as those matrices applied to each row of its first input; views and a multi-output op's parts free;
    every other op by its outputs written and read once at the memory bandwidth."""
    flops = traffic = 0
    for node in nodes:
        if node.target is operator.getitem or is_view(node):
            continue
        if node.target in BATCHED_MATMULS or node.target in MATMULS:
            a, b = (tensor_val(n) for n in matmul_operands(node))
            flops += 2 * numel_hint(a) * hint(b.shape[-1])
        elif is_linear_product(node):  # x @ deq(W)^T: (rows x in) by (in x out)
            x, out = tensor_val(node.args[0]), tensor_val(node)
            flops += 2 * numel_hint(out) * hint(x.shape[-1])
        elif is_fused_attention(node):
            flops += attention_flops(node)
        elif is_grouped_product(node):
            flops += _grouped_product_flops(node)
        elif matrices := _parameter_matrices(node):
            x = tensor_val(node.all_input_nodes[0])
            rows = numel_hint(x) // max(hint(x.shape[-1]), 1) if x is not None and x.dim() else 1
            flops += 2 * rows * sum(map(numel_hint, matrices))
        else:
            val = node.meta.get("val")
            outputs = val if isinstance(val, (tuple, list)) else (val,)
            traffic += sum(2 * numel_hint(t) * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
    return flops / matmul_rate(device) + traffic / memory_bandwidth(device)


def _grouped_product_flops(node: Node) -> int:
    """Each routed row (rows x in) times its expert's matrix (in x out); fxmem's grouped LoRA as its two products
    through the rank (its A stacked as experts x in x rank)."""
    x, out = tensor_val(node.args[0]), tensor_val(node)
    rows, width = numel_hint(x) // max(hint(x.shape[-1]), 1), hint(x.shape[-1])
    if schema_name(node.target) == GROUPED_LORA:
        return 2 * rows * hint(tensor_val(node.args[1]).shape[-1]) * (width + hint(out.shape[-1]))
    return 2 * numel_hint(out) * width


def _parameter_matrices(node: Node) -> list[torch.Tensor]:
    """The floating 2-d graph inputs a custom (not aten) op reads."""
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace in ("aten", "prims"):
        return []
    vals = (tensor_val(a) for a in node.all_input_nodes if a.op == "placeholder")
    return [v for v in vals if v is not None and v.dim() == 2 and v.is_floating_point()]


def product_seconds(rows: int, inner: int, cols: int, device: str = "cpu") -> float:
    """A (rows x inner) by (inner x cols) matmul replayed in backward, at the device's measured matmul rate."""
    return 2 * rows * inner * cols / matmul_rate(device)


def lowrank_seconds(rows: int, width: int, rank: int, niter: int, device: str = "cpu") -> float:
    """The sampling decomposition's products (2 + 2 niter of rows x width x rank) and the rebuild's one."""
    return 2 * rows * width * rank * (3 + 2 * niter) / matmul_rate(device)
