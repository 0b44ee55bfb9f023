"""The report's grouping of what the plan keeps exact, by the rule that kept it."""

import json

import fxmem
from fxmem.cost_model import planned_bytes
from fxmem.cost_model.plan import Action
from tests.conftest import tiny_model


def test_kept_bytes_are_grouped_by_rule_without_each_tensors_figures():
    model, batch = tiny_model("llama", lora=True, layers=2)
    report = fxmem.inspect(model, config=fxmem.Config.from_preset("hyclora-4bit"), guard=False, **batch)
    kept = report.kept_by_reason()
    exact = [(s, p) for _, s, p in report.rows() if p.action is Action.KEEP and s.frees_memory and not s.shares_storage_with]
    assert sum(e["bytes"] for e in kept.values()) == sum(s.nbytes for s, _ in exact) > 0
    assert sum(e["count"] for e in kept.values()) == len(exact)
    assert kept["kept exact: lora_intermediate"]["count"] == 2 * 7  # x @ A of every LoRA linear
    assert list(kept) == sorted(kept, key=lambda reason: -kept[reason]["bytes"])
    assert json.loads(report.to_json())["kept_by_reason"] == kept
    text = report.table(width=300)
    assert "Kept exact, by reason" in text and "kept exact: lora_intermediate" in text
    assert sum(planned_bytes(s, p) for s, p in exact) <= report.planned_bytes


def test_a_rules_figures_are_dropped_and_its_words_kept():
    from fxmem.report import _FIGURES
    assert _FIGURES.sub("", "quantizing would not shrink it (512 >= 384 bytes)") == "quantizing would not shrink it"
    assert _FIGURES.sub("", "per-head layout (4 x 16): q, k, v") == "per-head layout: q, k, v"
    kv = "a KV cache (use_cache=False in training frees it)"
    assert _FIGURES.sub("", kv) == kv


def test_under_exact_every_saved_byte_is_kept_and_accounted_for():
    model, batch = tiny_model("llama", lora=True, layers=1)
    report = fxmem.inspect(model, **batch)
    kept = report.kept_by_reason()
    assert sum(e["bytes"] for e in kept.values()) == report.activation_bytes == report.planned_bytes
    assert "no enabled technique applies to linear_input" in kept and "no enabled technique applies to attn_qkv" in kept
