import dataclasses

import pytest

from fxmem import PRESETS, Config, techniques


def test_every_config_field_belongs_to_exactly_one_technique():
    owners = [name for t in techniques.TECHNIQUES for name in t.fields] + list(techniques.GENERAL_FIELDS)
    assert sorted(owners) == sorted(f.name for f in dataclasses.fields(Config))


def test_every_pass_is_declared_once_in_the_order_and_served_by_a_technique():
    assert sorted(techniques.PASS_ORDER) == sorted(techniques.PASSES)
    served = {name for t in techniques.TECHNIQUES for name in t.passes}
    assert served == set(techniques.PASS_ORDER)
    assert [p.name for p in techniques.default_passes()] == list(techniques.PASS_ORDER)


def test_each_pass_lives_in_its_stages_folder_and_is_ordered_there():
    import pathlib
    import sys

    from fxmem.passes import dynamo, joint, partitioned
    for stage in (dynamo, joint, partitioned):
        folder = pathlib.Path(stage.__file__).parent
        for name in stage.ORDER:
            graph_pass = techniques.PASSES[name]
            assert graph_pass.stage == folder.name, name
            assert pathlib.Path(sys.modules[graph_pass.__module__].__file__).parent == folder, name


_ALWAYS = ["adapter_cast", "replay_dropout", "merge_casts", "recompute_inputs", "causal_mask", "gqa_attention"]
_EVERY_PRESETS_PASSES = ["causal_mask", "gqa_attention", "chunk_loss", "merge_casts", "recompute_adapter_cast",
                         "replay_dropout", "recompute_inputs"]


@pytest.mark.parametrize("preset, names, passes", [
    ("exact", [*_ALWAYS, "chunk_loss"], _EVERY_PRESETS_PASSES),
    ("hyclora-4bit", ["quantize", "lora_reorder", *_ALWAYS, "chunk_loss", "lora_half_products"],
     [*_EVERY_PRESETS_PASSES, "lora_reorder", "recompute_logits", "recompute_attention", "quantize", "fuse_epilogue",
      "lora_half_products"]),
    ("loract", ["quantize", "lowrank", *_ALWAYS, "chunk_loss", "lora_half_products"],
     [*_EVERY_PRESETS_PASSES, "recompute_logits", "recompute_attention", "quantize", "lowrank", "lora_half_products"]),
    ("runlora", ["runlora", *_ALWAYS, "chunk_loss"], [*_EVERY_PRESETS_PASSES, "runlora", "onednn_matmul"]),
])
def test_a_preset_turns_on_its_techniques_and_their_passes_in_the_declared_order(preset, names, passes):
    config = PRESETS[preset]
    assert [t.name for t in techniques.enabled_techniques(config)] == names
    assert [p.name for p in techniques.default_passes() if p.enabled(config)] == passes


def test_a_memory_budget_alone_runs_the_quantize_pass():
    config = Config(memory_budget=0.5)
    assert [t.name for t in techniques.enabled_techniques(config)] == [*_ALWAYS, "chunk_loss", "memory_budget"]
    assert "quantize" in [p.name for p in techniques.default_passes() if p.enabled(config)]
