import json

import pytest

from fxmem import cli


def test_profile_times_the_plan_with_and_without_compression_and_lists_its_kernels(tiny_workloads, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert cli.main(["bench", "profile", "--preset", "hyclora-4bit", "--steps", "1", "--top", "500",
                     "--json", str(out)]) == 0
    assert "compressing and decompressing take" in " ".join(capsys.readouterr().out.split())
    [result] = json.loads(out.read_text())["results"]
    assert len(result["step_samples"]) == len(result["uncompressed_samples"]) == len(result["compile_samples"]) == 1
    assert any("cpp_fused_" in entry["name"] for entry in result["top"])  # inductor's kernels, by name
    # every op of the step is listed (500 of them at most), so their self times add up to the step's
    assert result["profiled_seconds"] == pytest.approx(sum(entry["seconds"] for entry in result["top"]))
    assert result["compression_seconds"] == result["step_samples"][0] - result["uncompressed_samples"][0]
