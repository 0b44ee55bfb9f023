"""fxmem bench fidelity: gradients against eager in the workload's dtype and in fp32, before and after training."""

import json

import pytest
import torch

from fxmem import cli
from fxmem_bench.fidelity import measure
from fxmem_bench.workloads import LlamaShape, Workload

TINY_BF16 = Workload("test-llama3-bf16", "llama", 2, 32, "tiny GQA Llama in bf16 with fp32 adapters",
                     LlamaShape(64, 172, 2, 4, 256, kv_heads=2), dtype=torch.bfloat16, lora_alpha=32, lora_b_std=0.02)


def test_a_bf16_workload_is_built_as_users_load_one():
    model = TINY_BF16.build().model
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}  # PEFT's default on a bf16 model
    assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers() if b.is_floating_point()} == {torch.float32}  # RoPE's frequencies
    assert model.base_model.model.config.num_key_value_heads == 2
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert all(p.abs().max() > 0 for p in b) and 0.015 < torch.cat([p.flatten() for p in b]).std() < 0.025


def test_eager_is_its_own_reference_and_a_preset_is_compared_before_and_after_training():
    eager, fxmem = measure(TINY_BF16, ["eager", "hyclora-4bit"], steps=2, lowering="eager")
    for result in (eager, fxmem):
        assert [c.steps for c in result.comparisons] == [0, 2]
        assert result.dtype == "bfloat16"
    trainable = 2 * 7 * 2
    assert len(eager.comparisons[0].per_parameter) == trainable
    # the same computation
    assert all(c.same_dtype.median_relative_error == 0 and c.same_dtype.min_cosine > 1 - 1e-12
               for c in eager.comparisons)
    # bf16 against fp32: close, not equal (the floor any bf16 method starts from)
    assert 0.99 < eager.comparisons[0].fp32.min_cosine < 1.0
    assert fxmem.saved_bytes < eager.saved_bytes / 3
    for comparison in fxmem.comparisons:
        assert 0.98 < comparison.same_dtype.min_cosine < 1.0, comparison.same_dtype
        # against fp32, no worse than eager bf16's own figure minus 0.01 (issue 42's bar)
        assert comparison.fp32.min_cosine > eager.comparisons[0].fp32.min_cosine - 0.01


def test_each_method_starts_from_the_same_random_state_whatever_ran_before_it():
    # loract's rows are sampled: without the seed its second run would draw after the first's draws
    first, second = measure(TINY_BF16, ["loract", "loract"], lowering="eager")
    assert first.comparisons[0].same_dtype == second.comparisons[0].same_dtype
    assert first.comparisons[0].same_dtype.min_cosine < 0.99  # factored, so the draw shows


def test_random_tokens_span_the_vocabulary_and_bad_choices_are_refused():
    from fxmem_bench.fidelity import _random_batches
    setup = TINY_BF16.build()
    batches = _random_batches(TINY_BF16, setup.model, torch.device("cpu"))
    first = next(batches)
    vocab = setup.model.get_input_embeddings().num_embeddings
    ids = torch.cat([first["input_ids"], *(next(batches)["input_ids"] for _ in range(7))])
    assert first["input_ids"].shape == next(setup.batches)["input_ids"].shape and torch.equal(first["labels"],
                                                                                                first["input_ids"])
    assert ids.unique().numel() > 0.75 * vocab and ids.max() >= vocab - 8  # 8 x 64 uniform draws of 256: 86% expected
    assert torch.equal(next(_random_batches(TINY_BF16, setup.model, torch.device("cpu")))["input_ids"],
                       first["input_ids"])  # seeded
    [result] = measure(TINY_BF16, ["eager"], tokens="random", lowering="eager")
    assert result.comparisons[0].same_dtype.median_relative_error == 0
    with pytest.raises(ValueError, match="unknown method 'fast'; valid methods: eager, compile, exact"):
        measure(TINY_BF16, ["fast"])
    with pytest.raises(ValueError, match="tokens must be one of text, random"):
        measure(TINY_BF16, ["eager"], tokens="words")


def test_the_command_writes_a_row_per_method_and_json_as_each_method_ends(monkeypatch, tmp_path, capsys):
    from fxmem_bench import workloads
    monkeypatch.setattr(workloads, "get_workload", lambda name: TINY_BF16)
    path = tmp_path / "fidelity.json"
    from fxmem_bench.cli import fidelity as command
    written = []
    write_json = command.write_json
    monkeypatch.setattr(command, "write_json", lambda results, *a, **k: (written.append([r.method for r in results]),
                                                                       write_json(results, *a, **k)))
    assert cli.main(["bench", "fidelity", "--methods", "eager", "loract", "--lowering", "eager", "--time", "1",
                     "--no-logits", "--set", "lora_half_products=on", "--json", str(path)]) == 0
    assert written == [["eager"], ["eager", "loract"]]  # as each method ends
    out = capsys.readouterr().out
    assert "fxmem bench fidelity" in out and "min cos vs fp32" in out and "step vs eager" in out
    data = json.loads(path.read_text())
    assert [r["method"] for r in data["results"]] == ["eager", "loract"]
    assert data["options"] == {"lora_half_products": "on", "return_logits": False} and data["tokens"] == "text"
    assert all(r["step_seconds"] > 0 for r in data["results"])
