"""`fxmem inspect` on a HuggingFace config.json (the harness's workloads by name: tests/bench/test_cli.py)."""

import json
import re

import pytest

from fxmem import cli


def llama_json(directory, **shape) -> str:
    """A Llama config.json in ``directory``: the harness's llama-tiny shape (4 blocks, hidden 256, vocab 4096), or
    ``shape``'s overrides."""
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
              "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
              "vocab_size": 4096, **shape}
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory / "config.json")


@pytest.fixture
def llama_tiny(tmp_path) -> str:
    return llama_json(tmp_path)


def test_inspect_a_config_json(tmp_path, capsys):
    config = llama_json(tmp_path, hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=256)
    out = tmp_path / "report.json"
    assert cli.main(["inspect", config, "--batch", "2", "--seq", "16", "--lora-rank", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lora_intermediate" in printed and "x@A, r=4" in printed and "By layer" in printed
    report = json.loads(out.read_text())
    roles = {s["role"] for s in report["regions"][0]["saved"]}
    assert "unknown" not in roles and {"lora_intermediate", "attn_qkv", "norm_input"} <= roles


def test_inspect_with_a_memory_budget_plans_within_it_and_says_so(llama_tiny, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["inspect", llama_tiny, "--batch", "1", "--seq", "32", "--memory-budget", "0.5",
                     "--json", str(out)]) == 0
    assert "memory_budget 0.5: planned" in capsys.readouterr().out
    report = json.loads(out.read_text())
    [region] = report["regions"]
    assert report["planned_bytes"] <= region["budget_bytes"]
    assert cli.main(["inspect", llama_tiny, "--batch", "1", "--seq", "32", "--memory-budget", "100000",
                     "--json", str(out)]) == 0
    assert json.loads(out.read_text())["regions"][0]["budget_bytes"] == 100_000
    assert cli.main(["inspect", llama_tiny, "--memory-budget", "0"]) == 2
    assert "memory_budget must be a number in (0, 1.0], an integer number of bytes > 1" in capsys.readouterr().out


def test_inspect_sets_config_fields_and_shows_the_blocks_a_budget_checkpoints(llama_tiny, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["inspect", llama_tiny, "--batch", "1", "--seq", "32", "--memory-budget", "0.3",
                     "--set", "block_checkpoint=True", "--json", str(out)]) == 0
    [region] = json.loads(out.read_text())["regions"]
    [note] = [n for n in region["notes"] if n.startswith("memory_budget checkpoints ")]
    assert re.fullmatch(r"memory_budget checkpoints (base_model\.model\.model\.layers\.\d: a [\d.]+ ms forward for "
                        r"[\d.]+ MiB(; )?)+", note), note
    assert " ".join(note.split()) in " ".join(capsys.readouterr().out.split())  # the console wraps it
    assert cli.main(["inspect", llama_tiny, "--set", "block_checkpoint=maybe"]) == 2
    assert "block_checkpoint" in capsys.readouterr().out


def test_inspect_says_what_auto_chunking_chose(llama_tiny, tmp_path, capsys):
    out = tmp_path / "report.json"
    assert cli.main(["inspect", llama_tiny, "--batch", "1", "--seq", "512", "--set", "mlp_chunk=auto",
                     "--json", str(out)]) == 0
    [region] = json.loads(out.read_text())["regions"]
    assert re.fullmatch(r"mlp_chunk=auto: chunked, the step's activations predicted to peak at [\d.]+ MiB chunked "
                        r"and [\d.]+ MiB not \(chunked where 10% lower\)", region["notes"][0])
    assert region["config"]["mlp_chunk"] == "auto"
    assert "SwiGLU MLP(s) of 512 tokens" in capsys.readouterr().out


def test_inspect_names_a_missing_model(tmp_path):
    with pytest.raises(SystemExit, match="neither a workload"):
        cli.main(["inspect", str(tmp_path / "nope.json")])


