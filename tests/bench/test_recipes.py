"""The recipe matrix (issue 46): each recipe under exact and hyclora-4bit against torch.compile on the same recipe."""

import pytest

from fxmem_bench.cli.recipes import _table
from fxmem_bench.recipes import RecipeResult, measure
from fxmem_bench.workloads import LlamaShape, Workload, get_workload

TINY = Workload("recipes-tiny", "llama", 2, 32, "a 1-layer GQA Llama for the recipe matrix",
                LlamaShape(64, 172, 1, 4, 256, kv_heads=2))
PRESETS = ("exact", "hyclora-4bit")


@pytest.fixture(scope="module")
def plain() -> dict[str, RecipeResult]:
    return {r.method: r for r in measure(TINY, ["plain"], PRESETS)}


@pytest.mark.parametrize("recipe", ["dropout", "autocast", "packed", "accumulation", "qlora"])
def test_every_recipe_runs_exact_as_torch_compile_and_hyclora_at_the_plain_recipes_bytes(recipe, plain):
    results = {r.method: r for r in measure(TINY, [recipe], PRESETS)}
    exact, hyclora = results["exact"], results["hyclora-4bit"]
    assert exact.fallbacks == () and hyclora.fallbacks == ()
    # under autocast attention runs in bf16, where SDPA's grouped heads (gqa_attention) sum the key and value
    # gradients in another order: 0.0037 measured, where eager PEFT is 0.0062 from torch.compile on this recipe
    assert exact.max_relative_error < (5e-3 if recipe == "autocast" else 1e-5), exact
    assert hyclora.min_cosine > 0.99, hyclora
    assert hyclora.planned_bytes <= 1.10 * plain["hyclora-4bit"].planned_bytes, (hyclora, plain["hyclora-4bit"])


def test_the_table_compares_each_plan_with_the_plain_recipes_and_marks_a_missed_bound():
    results = [RecipeResult("plain", "exact", 8 << 20, 8 << 20, 1.0, "lora_A", 56, 0.0, ()),
               RecipeResult("plain", "hyclora-4bit", 4 << 20, 1 << 20, 0.999, "lora_A", 56, 0.01, ()),
               RecipeResult("packed", "hyclora-4bit", 4 << 20, 3 << 20, 0.9, "lora_A", 56, 0.3,
                            ("pass quantize failed",))]
    columns, rows, legend = _table(results, TINY)
    packed = dict(zip(columns, rows[-1], strict=True))
    assert packed["vs plain recipe"] == "3.00x" and packed["gradients compared"] == "56"
    assert packed["published bound"] == "0.995 (missed)"
    assert packed["fell back"] == "pass quantize failed"
    assert dict(zip(columns, rows[0], strict=True))["published bound"] == "0.9999"
    assert "position_ids restarting" in legend and "B drawn with std 0.02 past PEFT's zeros" in legend


def test_an_unknown_recipe_or_workload_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid recipes: plain, dropout, autocast, packed, accumulation, qlora"):
        measure(TINY, ["sharded"], PRESETS)
    with pytest.raises(ValueError, match="valid presets: exact"):
        measure(TINY, ["plain"], ["hyclora-3bit"])
    with pytest.raises(ValueError, match="recipes run on the random-weight llama workloads; got minilm-real"):
        measure(get_workload("minilm-real"), ["plain"], PRESETS)
