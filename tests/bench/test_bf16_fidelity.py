"""Every preset in bf16 (PEFT's fp32 adapters on a bf16 GQA Llama), through inductor's lowering: gradients against
eager bf16 within the bounds docs/quantization.md publishes, and against fp32 eager no worse than the lower of eager
bf16's own figure and the preset's against bf16, less 0.01."""

import pytest

from fxmem_bench.fidelity import measure
from tests.bench.test_fidelity import TINY_BF16

# The published floors (docs/benchmarks.md: llama3-bf16-small at the hyclora presets; this model measures 0.998). loract's rank-1/8 factors of random-weight activations lose what random
# activations hold outside any 1/8 of their dimensions (docs/loract.md): its bar is its own figure here, 0.853 at the
# fidelity bench's seed (0.80 to 0.88 over seeds 0-5; 0.53 while q, k and v were factored too).
BOUNDS = {"exact": 0.9995, "runlora": 0.9995, "hyclora-4bit": 0.992, "hyclora-2bit": 0.992, "loract": 0.8}


@pytest.fixture(scope="module")
def results():
    return {r.method: r for r in measure(TINY_BF16, ["eager", *BOUNDS], lowering="inductor",
                                         options={"return_logits": False})}


@pytest.mark.parametrize("preset", list(BOUNDS))
def test_a_preset_keeps_its_published_bf16_fidelity_through_inductor(results, preset):
    [comparison] = results[preset].comparisons
    floor = results["eager"].comparisons[0].fp32.min_cosine
    assert comparison.same_dtype.min_cosine >= BOUNDS[preset], comparison.same_dtype
    # against fp32: what the preset loses in any dtype, and no more than 0.01 for being in bf16
    assert comparison.fp32.min_cosine >= min(floor, comparison.same_dtype.min_cosine) - 0.01, (comparison.fp32, floor)
    assert results[preset].dtype == "bfloat16"
