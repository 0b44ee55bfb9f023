"""The llama-pretrained workload: its corpus split, a deterministic hash-checked build in the cache, and the command."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from fxmem import cli
from fxmem_bench import pretrained, workloads
from fxmem_bench.data import held_out, stdlib_files, stdlib_split_by_docstrings

TINY = pretrained.PretrainRecipe(hidden=32, ffn=64, layers=1, heads=2, batch=2, seq=32, steps=6, lr=1e-2, warmup=1,
                                 eval_every=3, eval_windows=4)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(pretrained, "RECIPE", TINY)
    return tmp_path


def test_pretraining_reads_code_without_docstrings_and_fine_tuning_reads_only_the_docstrings():
    split = stdlib_split_by_docstrings()
    assert len(split) == len(stdlib_files())
    index = [f.as_posix().endswith("/json/__init__.py") for f in stdlib_files()].index(True)
    code, docs = split[index]
    assert docs.startswith(b"JSON (JavaScript Object Notation)") and b"JSON (JavaScript Object Notation)" not in code
    assert b"def dumps(obj" in code and b"Serialize ``obj`` to a JSON formatted ``str``" in docs
    assert sum(map(len, (c for c, _ in split))) > 4 * sum(map(len, (d for _, d in split)))
    # Each side's eval files are never its training files.
    assert [held_out(i, 10) for i in range(10)] == [False] * 9 + [True]
    train, evaluation = workloads.docstring_windows(64, False), workloads.docstring_windows(64, True)
    assert train.shape[1] == evaluation.shape[1] == 64 and 0 < 2 * evaluation.shape[0] < train.shape[0] // 4


def test_a_build_is_deterministic_cached_and_checked_by_hash(cache):
    curve = []
    directory = pretrained.build(TINY, on_eval=lambda step, loss, accuracy: curve.append((step, loss)))
    assert directory == cache / f"llama-pretrained-{TINY.key}" and directory == pretrained.checkpoint_dir(TINY)
    manifest = json.loads((directory / pretrained.MANIFEST_FILE).read_text())
    assert [step for step, _ in curve] == [0, 3, 6] == [p["step"] for p in manifest["eval_curve"]]
    assert curve[0][1] == pytest.approx(math.log(256), rel=0.05) and curve[-1][1] < curve[0][1] - 0.5
    assert pretrained.verified_checkpoint(TINY) == directory
    first = manifest["sha256"]
    pretrained.build(TINY)  # again, over the cached one: the same weights to the bit
    assert pretrained.read_manifest(TINY)["sha256"] == first == pretrained.file_sha256(directory / "model.safetensors")
    assert pretrained.PretrainRecipe(seed=1).key != pretrained.PretrainRecipe().key  # another recipe, another entry
    setup = workloads.get_workload("llama-pretrained").build(lora_rank=4)  # the built weights, with LoRA
    loaded = setup.model.base_model.model.model.embed_tokens.weight
    assert torch.equal(loaded, load_file(directory / "model.safetensors")["model.embed_tokens.weight"])


def test_a_corrupted_or_missing_build_names_the_command_that_rebuilds_it(cache):
    with pytest.raises(FileNotFoundError, match="build them with `fxmem bench pretrain`"):
        pretrained.verified_checkpoint(TINY)
    directory = pretrained.build(TINY)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="do not match their recorded hash .* `fxmem bench pretrain --rebuild`"):
        pretrained.verified_checkpoint(TINY)
    assert cli.main(["bench", "pretrain"]) == 1
    assert cli.main(["bench", "pretrain", "--rebuild"]) == 0
    pretrained.verified_checkpoint(TINY)


def test_the_workload_fine_tunes_on_docstrings_and_evaluates_on_held_out_ones(cache, capsys):
    assert cli.main(["bench", "pretrain"]) == 0  # builds it: none cached
    out = capsys.readouterr().out
    assert "held-out code loss" in out and TINY.key in out and "(checked)" in out
    setup = workloads.get_workload("llama-pretrained").build(lora_rank=4)
    batch = next(setup.batches)
    assert batch["input_ids"].shape == (4, 256) and torch.equal(batch["input_ids"], batch["labels"])
    loss, accuracy = setup.evaluate(setup.model)
    assert 0 < loss < math.log(256) and 0 <= accuracy <= 1
    assert setup.model.training  # evaluation leaves the mode as it was


def test_ablate_reports_eval_loss_and_accuracy_where_the_workload_has_a_held_out_set(cache, capsys, tmp_path):
    pretrained.build(TINY)
    out = tmp_path / "ablate.json"
    assert cli.main(["bench", "ablate", "--workload", "llama-pretrained", "--steps", "3", "--settings",
                     "4-bit intra + inter", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "eval loss" in printed and "eval accuracy" in printed
    results = json.loads(out.read_text())["results"]
    assert [r["setting"] for r in results] == ["eager PEFT", "torch.compile", "4-bit intra + inter"]
    assert all(0 < r["eval_loss"] < math.log(256) and 0 <= r["eval_accuracy"] <= 1 for r in results)
    # Eager and torch.compile train the same model the same way: the same held-out figures, to rounding.
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-4)


def test_loading_absent_weights_says_it_pretrains_them_first(cache):
    with pytest.warns(UserWarning, match=r"absent from .*: pretraining them now \(about 20-30 minutes"):
        pretrained.load_pretrained(TINY)
    assert pretrained.verified_checkpoint(TINY).exists()
