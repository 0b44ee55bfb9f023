"""The harness's commands through `fxmem bench`, and `fxmem inspect` on the harness's workloads."""

import json
import re

import pytest

from fxmem import cli
from fxmem_bench.finetune import finetune
from tests.bench.conftest import ONE_LAYER_LLAMA


def test_inspect_a_workload_with_overridden_shape(capsys):
    assert cli.main(["inspect", "llama-tiny", "--batch", "1", "--seq", "32", "--lora-rank", "0"]) == 0
    printed = capsys.readouterr().out
    assert "(1, 32, 4096)" in printed  # the logits at the overridden shape
    assert "lora_intermediate" not in printed  # --lora-rank 0: full fine-tuning


def test_inspect_fidelity_ranks_the_gradients_and_each_compressed_tensor(monkeypatch, tmp_path, capsys):
    from fxmem_bench import workloads
    from tests.bench.test_fidelity import TINY_BF16
    monkeypatch.setattr(workloads, "get_workload", lambda name: TINY_BF16)
    out = tmp_path / "report.json"
    assert cli.main(["inspect", "llama3-bf16-small", "--preset", "hyclora-4bit", "--fidelity", "--json",
                     str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Gradients under hyclora-4bit against eager" in printed and "Each compressed tensor alone" in printed
    fidelity = json.loads(out.read_text())["fidelity"]
    assert fidelity["preset"] == "hyclora-4bit" and 0.98 < fidelity["min_cosine"] < 1
    assert fidelity["tensors"][0]["plan"] in ("4-bit codes", "8-bit codes")
    assert cli.main(["inspect", "llama3-bf16-small", "--fidelity"]) == 0  # exact: nothing to probe, and it says so
    assert "preset exact compresses nothing; name a lossy one (hyclora-4bit, hyclora-2bit, loract)" in \
        capsys.readouterr().out


def test_bad_counts_are_usage_errors(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "finetune", "--steps", "2"])
    assert "--steps: must be an integer >= 3; got 2" in capsys.readouterr().err


def test_finetune_command_learns_prints_the_side_by_side_table_and_exact_fxmem_matches_compile(
        one_layer_workloads, monkeypatch, capfd):
    from fxmem_bench import finetune as finetune_module
    returned = []

    def recording_finetune(*args, **kwargs):
        returned.append(finetune(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(finetune_module, "finetune", recording_finetune)
    assert cli.main(["bench", "finetune", "--steps", "10", "--lr", "1e-2"]) == 0
    captured = capfd.readouterr()  # file descriptors: the profiler's native lines bypass Python's streams
    printed = captured.out
    for expected in ("eager", "compile", "hf-checkpointing", "fxmem (exact)", "saved activations", "step peak",
                     "final loss"):
        assert expected in printed
    assert "profiler_start" not in captured.err  # silenced
    [(eager, compiled, checkpointed, ours)] = returned
    assert ours.losses == pytest.approx(compiled.losses, rel=1e-5)
    assert checkpointed.losses == pytest.approx(eager.losses, rel=1e-5)
    # torch.compile saves HF's attention mask as a float32 (batch, 1, seq, seq) tensor; fxmem never builds it
    mask = ONE_LAYER_LLAMA.batch * ONE_LAYER_LLAMA.seq**2 * 4
    assert ours.saved_bytes == compiled.saved_bytes - mask and checkpointed.saved_bytes > 0
    assert ours.final_loss < 0.95 * ours.losses[0]  # it really trains


def test_bench_runs_every_baseline_and_writes_json_and_markdown(one_layer_workloads, tmp_path, capsys):
    json_path, markdown_path = tmp_path / "bench.json", tmp_path / "bench.md"
    # compile-budget and the compiled checkpointing baselines are tested apart (tests/bench/test_compare.py):
    # compiling them costs a minute each
    methods = ["eager", "compile", "hf-checkpointing", "fxmem"]
    assert cli.main(["bench", "--workloads", "llama-tiny", "--steps", "3", "--methods", *methods, "--json",
                     str(json_path), "--markdown", str(markdown_path), "--set", "chunk_loss=False", "--dtype",
                     "fp32"]) == 0
    assert "preset exact, chunk_loss=False; in fp32" in capsys.readouterr().out
    data = json.loads(json_path.read_text())
    assert data["options"] == {"chunk_loss": False}
    results = {r["method"]: r for r in data["results"]}
    assert set(results) == {"eager", "compile", "hf-checkpointing", "fxmem"}
    assert results["eager"]["fidelity"] is None  # the reference
    assert results["fxmem"]["fidelity"]["min_cosine"] > 0.99999
    mask = ONE_LAYER_LLAMA.batch * ONE_LAYER_LLAMA.seq**2 * 4  # saved by torch.compile, never built by fxmem (causal_mask)
    assert results["fxmem"]["saved_bytes"] == results["compile"]["saved_bytes"] - mask
    assert results["hf-checkpointing"]["saved_bytes"] < results["eager"]["saved_bytes"]
    assert all(len(r["step_samples"]) == 3 and r["static_bytes"] > 0 and r["peak_bytes"] > 0
               for r in results.values())
    markdown = markdown_path.read_text()
    assert "| workload | method | saved activations |" in markdown and "Command: `fxmem bench" in markdown
    assert "- step peak: " in markdown
    assert re.search(r"\| \d+\.\d\dx \(\d+\.\d\d-\d+\.\d\d\) \|", markdown)  # ratios with their rounds' range
    with pytest.raises(SystemExit):  # fewer than 3 rounds: no range to speak of
        cli.main(["bench", "--workloads", "llama-tiny", "--steps", "2"])


def test_bench_compare_refuses_overrides_that_have_their_own_option(tiny_workloads, capsys):
    for argv, message in [(["--set", "preset=exact"], "--set preset=...: use --preset"),
                          (["--set", "return_logits=False"], "--set return_logits=...: use --drop-logits"),
                          (["--set", "bits=3"], "bits must be one of 1, 2, 4, 8, None; got 3"),
                          (["--frontier", "--set", "memory_budget=0.5"],
                           "--frontier sets memory_budget to each of --targets: drop --set memory_budget"),
                          (["--frontier", "--dtype", "bf16"], "--frontier runs in the workload's dtype: drop --dtype")]:
        assert cli.main(["bench", "--workloads", "llama-tiny", *argv]) == 2
        assert message in capsys.readouterr().out
