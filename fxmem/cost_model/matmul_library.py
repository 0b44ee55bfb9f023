"""Which library runs a CPU fp32 matrix product faster on this machine: aten's (MKL) or oneDNN's; and whether a
product of fp32 operands runs faster with half-precision inputs (``half_product_faster``).

FLOPs cannot rank two libraries computing the same product, and the answer
differs between CPUs (MKL is fast on Intel, slow on AMD), so it is measured:
once per process for each product shape and operand layout, on random
operands, interleaved so that drift falls on both. The products that pay off
are the large ones (a frozen weight's n x i x o); the probe caps the rows,
which do not change which library wins (checked from 256 to 2048 rows on
llama-small's shapes and its 32000-wide head), to bound its cost at compile
time, and gives small products more rounds (their times are noisier).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fxmem.kernels.onednn_matmul import ONEDNN_DTYPES, onednn_available, onednn_mm
from fxmem.timing import interleaved_step_times, median, step_times

MatmulLibrary = Literal["aten", "onednn"]  # fxmem/kernels/onednn_matmul.py's MATMUL_LIBRARIES
# Probe rows: at most MAX_PROBE_ROWS, fewer for wide products (PROBE_FLOPS per run), never below MIN_PROBE_ROWS.
MIN_PROBE_ROWS, MAX_PROBE_ROWS = 256, 2048
PROBE_FLOPS = 2**33
MIN_ROUNDS, MAX_ROUNDS = 3, 50
PROBE_SECONDS = 0.02  # per library: small products get more rounds, up to MAX_ROUNDS

_CHOICES: dict[tuple[int, int, int, bool, torch.dtype], MatmulLibrary] = {}


def cpu_matmul_library(rows: int, inner: int, cols: int, *, b_transposed: bool,
                       dtype: torch.dtype = torch.float32) -> MatmulLibrary:
    """The faster library for a CPU (rows x inner) @ (inner x cols) product, measured once per process.

    ``b_transposed``: the right operand is a transposed view of a row-major (cols x inner) tensor, as a linear
    layer's W^T is in forward. "aten" wherever oneDNN cannot run the product (other dtypes, a build without it).
    """
    if dtype not in ONEDNN_DTYPES or not onednn_available():
        return "aten"
    rows = _probe_rows(rows, inner, cols)
    key = (rows, inner, cols, b_transposed, dtype)
    if key in _CHOICES:
        return _CHOICES[key]
    # Called at compile time, inside AOTAutograd's fake-tensor mode: leave it, or the products would be fake.
    with _disable_current_modes(), torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        a = torch.randn(rows, inner, generator=generator, dtype=dtype)
        b = (torch.randn(cols, inner, generator=generator, dtype=dtype).t() if b_transposed
             else torch.randn(inner, cols, generator=generator, dtype=dtype))
        times = _median_times({"aten": lambda: a @ b, "onednn": lambda: onednn_mm(a, b)})
    choice: MatmulLibrary = "onednn" if times["onednn"] < times["aten"] else "aten"
    _CHOICES[key] = choice
    return choice


def _probe_rows(rows: int, inner: int, cols: int) -> int:
    """The rows a probe times: at most MAX_PROBE_ROWS, fewer for wide products, never below MIN_PROBE_ROWS."""
    return min(rows, MAX_PROBE_ROWS, max(MIN_PROBE_ROWS, PROBE_FLOPS // (2 * inner * cols)))


def _median_times(candidates: dict[str, Callable[[], object]], device: torch.device | str = "cpu"
                  ) -> dict[str, float]:
    """Each candidate's median time, taken interleaved: after one warm-up each, as many rounds as PROBE_SECONDS
    allows the slowest (from MIN_ROUNDS to MAX_ROUNDS)."""
    once = max(step_times(product, steps=1, device=device)[0] for product in candidates.values())
    rounds = min(MAX_ROUNDS, max(MIN_ROUNDS, math.ceil(PROBE_SECONDS / max(once, 1e-9))))
    times = interleaved_step_times(candidates, steps=rounds, warmup=0, device=device)
    return {name: median(samples) for name, samples in times.items()}


def weight_libraries(x: torch.Tensor, weight: torch.Tensor) -> tuple[str, str]:
    """What runs a LoRA linear's products with W, forward (X W^T) and backward (dY W), on x's device: on the CPU
    the library the cost model measured faster for this shape, elsewhere aten's."""
    if x.device.type != "cpu":
        return "aten", "aten"
    rows = x.numel() // x.shape[-1]
    out_features, in_features = weight.shape
    return (cpu_matmul_library(rows, in_features, out_features, b_transposed=True, dtype=weight.dtype),
            cpu_matmul_library(rows, out_features, in_features, b_transposed=False, dtype=weight.dtype))


_HALF_CHOICES: dict[tuple[int, int, int, torch.dtype, str], bool] = {}


def half_product_faster(rows: int, inner: int, cols: int, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether (rows x inner) @ (inner x cols) runs faster with ``dtype`` (bf16 or fp16) inputs than in fp32 on
    ``device``, measured once per process for each shape: a GPU's tensor cores take half-precision inputs (and
    accumulate in fp32); a CPU without half-precision matrix units runs them far slower. The operands' casts are
    not timed: one is the model's own half-precision x, the other a rank-r factor or gradient. A device that runs
    no kernels (meta), or a CPU without matrix instructions for ``dtype``, measures nothing: False."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda") or device.type == "cpu" and not cpu_half_matmul_units(dtype):
        return False
    rows = _probe_rows(rows, inner, cols)
    key = (rows, inner, cols, dtype, str(device))
    if key in _HALF_CHOICES:
        return _HALF_CHOICES[key]
    with _disable_current_modes(), torch.no_grad():
        generator = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(rows, inner, generator=generator, device=device)
        b = torch.randn(inner, cols, generator=generator, device=device)
        a_half, b_half = a.to(dtype), b.to(dtype)
        times = _median_times({"fp32": lambda: a @ b, "half": lambda: (a_half @ b_half).float()}, device)
    faster = times["half"] < times["fp32"]
    _HALF_CHOICES[key] = faster
    return faster


def cpu_half_matmul_units(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions that multiply ``dtype`` matrices natively (AVX512-BF16 or AMX for bf16,
    AMX-FP16 for fp16); without them a half-precision product is converted and runs slower than fp32's."""
    if dtype == torch.bfloat16:
        return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return dtype == torch.float16 and torch.cpu._is_amx_fp16_supported()
