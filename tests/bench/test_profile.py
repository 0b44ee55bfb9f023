import json

import pytest
import torch

from fxmem import cli
from fxmem_bench.profile import launched_kernels


def test_profile_times_the_plan_with_and_without_compression_and_lists_its_kernels(one_layer_workloads, tmp_path,
                                                                                    capsys):
    out = tmp_path / "profile.json"
    assert cli.main(["bench", "profile", "--preset", "hyclora-4bit", "--steps", "1", "--top", "500", "--drop-logits",
                     "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "compressing and decompressing take" in printed and "hyclora-4bit, fxmem returning no logits" in printed
    [result] = json.loads(out.read_text())["results"]
    assert len(result["step_samples"]) == len(result["uncompressed_samples"]) == len(result["compile_samples"]) == 1
    assert any("cpp_fused_" in entry["name"] for entry in result["top"])  # inductor's kernels, by name
    # every op of the step is listed (500 of them at most), so their self times add up to the step's
    assert result["profiled_seconds"] == pytest.approx(sum(entry["seconds"] for entry in result["top"]))
    assert result["compression_seconds"] == result["step_samples"][0] - result["uncompressed_samples"][0]
    assert result["launches"] > 0 and result["compile_launches"] > 0
    assert (f"Kernels launched by a forward and backward: {result['launches']} (torch.compile: "
            f"{result['compile_launches']};") in printed


@pytest.mark.parametrize("work, kernels", [
    (lambda a, b: (a @ b).relu().sum(), 3),  # mm (its resolve_conj inside is none), relu, sum
    (lambda a, b: a.t().contiguous().to(torch.float32), 1),  # the copy; a view and a no-op cast are none
    (lambda a, b: a.to(torch.bfloat16).view(-1), 1),
])
def test_launched_kernels_counts_the_ops_that_run_one(work, kernels):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        work(a, b)
    assert launched_kernels(list(profiler.events()), torch.device("cpu")) == kernels


def test_a_generated_kernel_counts_once():
    fused = torch.compile(lambda a: (a.exp() * 2).sum(1).relu(), dynamic=False)
    a = torch.randn(8, 8)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        fused(a)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            fused(a)
    events = list(profiler.events())
    generated = [e for e in events if "cpp_fused" in e.name]
    assert len(generated) == 1
    assert launched_kernels(events, torch.device("cpu")) == 1
