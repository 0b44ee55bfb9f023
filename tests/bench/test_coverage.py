"""fxmem bench coverage: tiny configs of transformers' families under fxmem."""

import pytest

from fxmem_bench.choices import COVERAGE_FAMILIES
from fxmem_bench.coverage import FAMILIES, get_family, measure


def test_the_command_offers_every_family():
    # `fxmem bench coverage --families` takes COVERAGE_FAMILIES, without importing torch to read FAMILIES
    assert tuple(f.name for f in FAMILIES) == COVERAGE_FAMILIES


def test_a_fused_qkv_split_after_its_matmul_is_compressed_not_left_as_it_was():
    # GPT-NeoX: one q/k/v projection, split (and partial rotary) after it. The saved q, k and v are items of a
    # split: backward rebuilds them by copying the split with them.
    [result] = measure(get_family("gpt_neox"), ["hyclora-4bit"])
    assert not [reason for reason in result.kept if "left as it was" in reason], result.kept
    assert result.saved_bytes == result.planned_bytes
    assert result.reduction > 3.0  # 2.17x while the split's items were kept
    assert result.fidelity.min_cosine > 0.99


def test_a_fused_qkv_split_into_items_is_rebuilt_and_its_attention_recomputed():
    # GPT-NeoX again: the split's items (getitem) are part of the q/k/v projection's epilogue. They were not, so
    # the attention read the output through nodes the epilogue had not reached, lora_reorder failed, and its
    # stage (logits and attention recomputation) was rolled back: attention's output and the logits stayed saved.
    [result] = measure(get_family("gpt_neox"), ["hyclora-4bit"])
    assert not [reason for reason in result.kept if "attn_out" in reason or "forward output" in reason], result.kept
    assert result.reduction > 5.0  # 3.16x before
    assert result.fidelity.min_cosine > 0.99


def test_a_relu_output_is_saved_with_its_positive_values_kept_so_its_gradient_mask_is_exact():
    # OPT's ReLU MLP: its fc1 output is not rebuilt from X W, and no positive value of its saved output rounds to 0.
    for preset, before in (("hyclora-4bit", 0.915), ("hyclora-2bit", 0.680)):
        [result] = measure(get_family("opt"), [preset])
        assert result.fidelity.min_cosine > 0.99, (preset, before, result.fidelity)


def test_a_relu_output_keeps_its_positive_values_only_where_that_is_safe():
    import torch

    from fxmem.backend import Backend
    from fxmem.config import Config
    from fxmem_bench.coverage import build

    # static calibration: a channel all zero while calibrating would bring a later small value back as 1
    for overrides, kept in (({}, True), ({"calibration": "static"}, False), ({"stochastic_rounding": True}, False)):
        model, batch = build(get_family("opt"))
        # rebuild_from_x off: the ReLU output is saved, not rebuilt from fc1's replayed X W
        backend = Backend(Config.from_preset("hyclora-4bit", rebuild_from_x=False, **overrides), lowering="eager")
        torch.compile(model, backend=backend)(**batch).loss.backward()
        plans = [plan for _, saved, plan in backend.report().rows() if saved.producer == "relu"]
        assert len(plans) == 2 and all(p.keep_positive is kept for p in plans), overrides
        assert all(("positive values kept positive" in p.reason) is kept for p in plans)
        torch._dynamo.reset()


def test_an_attention_output_stored_per_head_gets_a_scale_per_channel_of_the_view_backward_reads():
    # GPT-NeoX's dense input is a (tokens, heads, head dim) clone read as (tokens, hidden): quantized with the
    # head dim as its channels, one scale served every head (worst gradient cosine after 50 steps 0.9875; 0.9951).
    import torch

    from fxmem.backend import Backend
    from fxmem.config import Config
    from fxmem.measure import gradient_fidelity, trainable_gradients
    from fxmem_bench.coverage import HIDDEN, build

    model, batch = build(get_family("gpt_neox"))
    model(**batch).loss.backward()
    reference = trainable_gradients(model)
    model.zero_grad(set_to_none=True)
    backend = Backend(Config.from_preset("hyclora-4bit"), lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    plans = [plan for _, saved, plan in backend.report().rows() if saved.producer == "clone"]
    assert len(plans) == 2 and all((p.action, p.channels, p.merged) == ("quantize", HIDDEN, 2) for p in plans)
    assert gradient_fidelity(reference, trainable_gradients(model)).min_cosine > 0.99


def test_attention_with_a_sink_column_is_rebuilt_from_q_and_k_and_clamped_experts_are_compressed():
    # gpt-oss: its eager attention joins a sink column to the scores (cat) and subtracts each row's max before the
    # softmax. The chain from q k^T was not recognised: scores, probabilities and q, k, v were kept (2.68x then,
    # without LoRA on the experts).
    for dtype in ("fp32", "bf16"):
        [result] = measure(get_family("gpt_oss"), ["hyclora-4bit"], dtype=dtype)
        kept = " ".join(result.kept)
        assert "attn_probs" not in kept and "unknown" not in kept, (dtype, result.kept)
        # in bf16 the clamps run in float32: the gate and up halves reach their product through casts, clamps and
        # a + 1, and were of role unknown, kept (3.86x)
        assert result.reduction > 6.0, (dtype, result.reduction)  # 13.2x fp32, 8.3x bf16
        assert result.fidelity.min_cosine >= 0.995, (dtype, result.fidelity)


def test_a_norm_input_backward_rebuilds_a_linear_input_from_gets_the_linear_inputs_bits():
    # DeepSeek-V3's latent attention: backward rebuilds kv_b_proj's input (kv_a_layernorm's output) from the norm's
    # input, which hyclora-2bit stored at 2 bits as a norm input: kv_b_proj's LoRA A gradient at 0.957.
    [result] = measure(get_family("deepseek_v3"), ["hyclora-2bit"])
    assert result.fidelity.min_cosine >= 0.99, result.fidelity


def test_an_unknown_family_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown family 'mamba'; valid families: llama, qwen2"):
        get_family("mamba")


def test_negative_steps_are_refused(capsys):
    from fxmem import cli
    assert cli.main(["bench", "coverage", "--families", "gpt2", "--steps", "-1"]) == 2
    assert "--steps must be 0 (no training) or more; got -1" in capsys.readouterr().out


def test_the_command_tables_each_family_against_llama(monkeypatch, capsys, tmp_path):
    import json

    from fxmem import cli
    from fxmem_bench.cli import coverage as command
    assert len(FAMILIES) >= 8
    json_path = tmp_path / "c.json"
    assert cli.main(["bench", "coverage", "--families", "gpt2", "--presets", "hyclora-4bit", "--dtypes", "bf16",
                     "--steps", "2", "--json", str(json_path)]) == 0
    printed = capsys.readouterr().out
    assert "gpt2" in printed and "vs llama" in printed and "Conv1D" in printed and "after 2 steps" in printed
    results = json.loads(json_path.read_text())["results"]
    assert [(r["family"], r["dtype"]) for r in results] == [(command.REFERENCE, "bf16"), ("gpt2", "bf16")]
    assert all(r["fidelity"]["compared"] > 0 and r["fidelity"]["zero_in_reference"] == 0 for r in results)
    assert all(r["saved_bytes"] < r["eager_bytes"] for r in results)
    # trained: the adapters moved, so the gradients differ from the initial weights' and so does their fidelity
    assert all(r["steps"] == 2 and r["trained_fidelity"]["min_cosine"] != r["fidelity"]["min_cosine"]
               for r in results)
