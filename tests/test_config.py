import pytest
import torch

import fxmem
from fxmem import PRESETS, Config, techniques
from fxmem.backend import fxmem_backend


def test_defaults_are_the_exact_preset():
    assert Config() == PRESETS["exact"] == Config.from_preset("exact")
    # exact: on everywhere, all lossless
    enabled = [t.name for t in techniques.enabled_techniques(Config())]
    assert enabled == ["adapter_cast", "replay_dropout", "merge_casts", "recompute_inputs", "causal_mask",
                       "gqa_attention", "chunk_loss"]


CHUNK_RANGE = "must be an integer number of tokens >= 1, 'auto' (chunked where the step's predicted peak drops) or None (off)"


@pytest.mark.parametrize("field, value, expected", [
    ("bits", 3, "bits must be one of 1, 2, 4, 8, None"),
    ("bits", True, "bits must be one of 1, 2, 4, 8, None"),
    ("qkv_bits", 16, "qkv_bits must be one of 1, 2, 4, 8, None"),
    ("linear_input_bits", 3, "linear_input_bits must be one of 1, 2, 4, 8, None"),
    ("outlier_ratio", -0.1, "outlier_ratio must be a number in [0, 0.5)"),
    ("outlier_ratio", 0.5, "outlier_ratio must be a number in [0, 0.5)"),
    ("attn_sparsity", 0.0, "attn_sparsity must be a number in (0, 1.0] or None (off)"),
    ("attn_sparsity", 1.5, "attn_sparsity must be a number in (0, 1.0] or None (off)"),
    ("calibration_steps", 0, "calibration_steps must be an integer >= 1"),
    ("calibration_steps", 2.5, "calibration_steps must be an integer >= 1"),
    ("lora_reorder", 1, "lora_reorder must be True or False"),
    ("lora_reorder", True, "lora_reorder stores X W quantized: set bits (one of 1, 2, 4, 8) too"),
    ("rebuild_from_x", 1, "rebuild_from_x must be True or False"),
    ("fused_epilogue", 1, "fused_epilogue must be True or False"),
    ("fused_epilogue", True, "fused_epilogue fuses the outputs lora_reorder rebuilds: set lora_reorder=True too"),
    ("intra", 0, "intra must be True or False"),
    ("intra", False, "intra=False quantizes only what lora_reorder saves: set lora_reorder=True too"),
    ("prenorm_sharing", "no", "prenorm_sharing must be True or False"),
    ("prenorm_sharing", False, "prenorm_sharing=False turns off a part of lowrank: set lowrank too"),
    ("lowrank", 1.0, "lowrank must be a ratio in (0, 1) of the last dimension, an integer rank >= 1"),
    ("lowrank", 0, "lowrank must be a ratio in (0, 1) of the last dimension, an integer rank >= 1"),
    ("lowrank", True, "lowrank must be a ratio in (0, 1) of the last dimension, an integer rank >= 1"),
    ("runlora", "fastest", "runlora must be one of 'off', 'flops', 'time'"),
    ("memory_budget", 0.0, "memory_budget must be a number in (0, 1.0], an integer number of bytes > 1 or None (off)"),
    ("memory_budget", 1.5, "memory_budget must be a number in (0, 1.0], an integer number of bytes > 1 or None (off)"),
    ("memory_budget", -3, "memory_budget must be a number in (0, 1.0], an integer number of bytes > 1 or None (off)"),
    ("rotation", 48, "rotation must be a power of two from 8 to 256 (8, 16, 32, 64, 128, 256) or None (off); got 48"),
    ("rotation", True, "rotation must be a power of two from 8 to 256"),
    ("rotation", 64, "rotation applies to quantized tensors: set bits (one of 1, 2, 4, 8) or memory_budget too"),
    ("stochastic_rounding", 1, "stochastic_rounding must be True or False"),
    ("stochastic_rounding", True, "stochastic_rounding applies to quantized tensors: set bits"),
    ("mlp_chunk", 0, f"mlp_chunk {CHUNK_RANGE}; got 0"),
    ("mlp_chunk", 64.0, f"mlp_chunk {CHUNK_RANGE}; got 64.0"),
    ("mlp_chunk", "Auto", f"mlp_chunk {CHUNK_RANGE}; got 'Auto'"),
    ("mlp_chunk", True, "mlp_chunk must be an integer number of tokens >= 1"),
    ("linear_chunk", -8, f"linear_chunk {CHUNK_RANGE}; got -8"),
    ("norm_chunk", -8, f"norm_chunk {CHUNK_RANGE}; got -8"),
    ("norm_chunk", "512", f"norm_chunk {CHUNK_RANGE}; got '512'"),
    ("block_checkpoint", 1, ("block_checkpoint must be True, False or 'auto' (checkpointed where the step's "
                             "predicted peak drops); got 1")),
    ("block_checkpoint", "Auto", "block_checkpoint must be True, False or 'auto'"),
    ("block_input_bits", 2, "block_input_bits must be one of 4, 8, None; got 2"),
    ("block_input_bits", 4, "block_input_bits sets the bits of a checkpointed block's stored input: set "
                            "block_checkpoint=True and bits"),
])
def test_bad_values_name_the_valid_range(field, value, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Config(**{field: value})
    with pytest.raises(ValueError):
        Config().replace(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("bits", 1), ("bits", 8), ("outlier_ratio", 0.0), ("attn_sparsity", 1.0), ("calibration_steps", 100),
    ("lowrank", 0.125), ("lowrank", 32), ("runlora", "time"), ("memory_budget", 0.5),
    ("memory_budget", 1), ("memory_budget", 2**20), ("mlp_chunk", 1), ("mlp_chunk", 4096), ("norm_chunk", 2048),
    ("linear_chunk", 2048), ("mlp_chunk", "auto"), ("norm_chunk", "auto"), ("linear_chunk", "auto"),
    ("block_checkpoint", "auto"),
])
def test_good_values_are_accepted(field, value):
    assert getattr(Config(**{field: value}), field) == value


def test_a_budget_takes_block_checkpoint_true_not_auto():
    with pytest.raises(ValueError, match="memory_budget weighs each block's checkpoint among its options already: "
                                         "set block_checkpoint=True with it, not 'auto'"):
        Config(memory_budget=0.5, block_checkpoint="auto")
    assert Config(memory_budget=0.5, block_checkpoint=True).block_checkpoint


def test_rotation_and_stochastic_rounding_go_with_bits_or_a_budget():
    assert Config(bits=2, rotation=128, stochastic_rounding=True).rotation == 128
    assert Config(memory_budget=0.5, rotation=8).rotation == 8


def test_unknown_preset_and_option_name_the_valid_ones():
    with pytest.raises(ValueError, match="unknown preset 'fast'; valid presets: exact, hyclora-4bit"):
        Config.from_preset("fast")
    with pytest.raises(ValueError, match=r"unknown fxmem option\(s\) bitz; valid options: bits, qkv_bits, linear_input_bits, outlier_ratio"):
        Config().replace(bitz=4)


def test_backend_options_are_validated_before_compiling():
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        fxmem_backend(gm, [torch.randn(1, 2)], options={"preset": "nope"})
    with pytest.raises(ValueError, match=r"unknown option 'bitz': neither an fxmem option \(attn_sparsity, .*\) nor an "
                                         r"inductor config name \(torch._inductor.config, e.g. 'triton.cudagraphs'\)"):
        fxmem_backend(gm, [torch.randn(1, 2)], options={"bitz": 2})
    for name in ("triton", "custom_partitioner_fn"):  # a config submodule, and the hook fxmem itself fills
        with pytest.raises(ValueError, match=f"unknown option '{name}'"):
            fxmem_backend(gm, [torch.randn(1, 2)], options={name: None})
    with pytest.raises(ValueError, match=r"memory_budget must be a number in \(0, 1.0\]"):
        fxmem_backend(gm, [torch.randn(1, 2)], options={"memory_budget": 0})


def test_backend_rejects_unknown_lowering():
    with pytest.raises(ValueError, match="lowering must be one of inductor, eager"):
        fxmem.Backend(lowering="tvm")


def test_calibration_mode_is_validated():
    assert Config(calibration="dynamic").calibration == "dynamic"
    assert Config().calibration == "dynamic"
    with pytest.raises(ValueError, match="calibration must be one of 'dynamic', 'static'; got 'weekly'"):
        Config(calibration="weekly")


def test_hyclora_presets_quantize_and_prune_no_attention_by_a_fixed_count():
    four, two = Config.from_preset("hyclora-4bit"), Config.from_preset("hyclora-2bit")
    assert (four.bits, two.bits, four.outlier_ratio, four.calibration_steps) == (4, 2, 0.005, 5)
    assert four.attn_sparsity is None and two.attn_sparsity is None
    assert four.lora_reorder and two.lora_reorder and four.intra and two.intra  # the paper's best rows: intra + inter
    assert Config(bits=2, lora_reorder=True, intra=False).intra is False
    fxmem.backend(preset="hyclora-2bit", outlier_ratio=0.0, calibration_steps=2)  # built: no NotImplementedError
