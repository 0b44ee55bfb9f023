"""Which library runs a CPU fp32 matrix product faster on this machine: aten's (MKL) or oneDNN's; and whether the
device runs bf16 products on tensor cores (``half_tensor_cores``).

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


# bf16 tensor cores: NVIDIA compute capability 8.0 (Ampere) and later
BF16_TENSOR_CORE_CAPABILITY = (8, 0)


def half_tensor_cores(device: torch.device | str) -> bool:
    """Whether ``device`` runs bf16 products on tensor cores (a CUDA GPU of compute capability 8.0 or later): there
    bf16 inputs run at several times the fp32 CUDA-core rate and read half the bytes, so a LoRA product with bf16
    inputs and float32 accumulation is the faster one whatever its shape, and the choice is a rule on the device, the
    same in every run. A CPU answers no: its bf16 instructions (AVX512-BF16, AMX) win or lose by shape
    (docs/cost_model.md), and a timing race between the two chose differently from one run to the next."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= BF16_TENSOR_CORE_CAPABILITY
