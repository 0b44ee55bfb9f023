"""fxmem bench coverage: tiny configs of transformers' families under fxmem."""

import pytest

from fxmem.bench.coverage import FAMILIES, get_family, measure


def test_a_fused_qkv_split_after_its_matmul_is_compressed_not_left_as_it_was():
    # GPT-NeoX: one q/k/v projection, split (and partial rotary) after it. The saved q, k and v are items of a
    # split: backward rebuilds them by copying the split with them.
    [result] = measure(get_family("gpt_neox"), ["hyclora-4bit"])
    assert not [reason for reason in result.kept if "left as it was" in reason], result.kept
    assert result.saved_bytes == result.planned_bytes
    assert result.reduction > 3.0  # 2.17x while the split's items were kept
    assert result.fidelity.min_cosine > 0.99


def test_an_unknown_family_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown family 'mamba'; valid families: llama, qwen2"):
        get_family("mamba")


def test_the_command_tables_each_family_against_llama(monkeypatch, capsys, tmp_path):
    import json

    from fxmem import cli
    from fxmem.cli.bench import coverage as command
    assert len(FAMILIES) >= 8
    assert cli.main(["bench", "coverage", "--families", "gpt2", "--json", str(tmp_path / "c.json")]) == 0
    printed = capsys.readouterr().out
    assert "gpt2" in printed and "vs llama" in printed and "Conv1D" in printed
    results = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [r["family"] for r in results] == [command.REFERENCE, "gpt2"]
    assert all(r["saved_bytes"] < r["eager_bytes"] for r in results)
