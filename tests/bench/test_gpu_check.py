import json
import statistics

import pytest

from fxmem import cli
from fxmem_bench.gpu_check import POINT_KEYS, check_points


def test_the_check_runs_its_points_and_writes_the_table_targets_and_profiles(one_layer_workloads, tmp_path, capsys):
    # on the CPU, for its mechanics: three points, the profiled one among them
    out = tmp_path / "gpu-check.json"
    assert cli.main(["bench", "gpu-check", "--workload", "llama-tiny", "--device", "cpu", "--points", "eager",
                     "compile", "hyclora-4bit-no-logits", "--top", "500", "--json", str(out)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    [check] = json.loads(out.read_text())["results"]
    points = {p["point"]: p for p in check["points"]}
    assert list(points) == ["eager", "compile", "hyclora-4bit-no-logits"]
    assert points["eager"]["fidelity"] is None
    assert points["hyclora-4bit-no-logits"]["fidelity"]["min_cosine"] > 0.99
    assert points["hyclora-4bit-no-logits"]["fidelity_bound"] == 0.995 and points["compile"]["fidelity_bound"] is None
    assert all(len(p["step_samples"]) == 3 and p["peak_bytes"] > 0 for p in points.values())
    ratio = points["hyclora-4bit-no-logits"]["step_vs_compile"]
    assert ratio == pytest.approx(statistics.median(points["hyclora-4bit-no-logits"]["step_samples"])
                                  / statistics.median(points["compile"]["step_samples"]))
    assert f"- hyclora-4bit-no-logits: {ratio:.2f}x torch.compile's step, target at most 1.10x" in printed
    assert [p["point"] for p in check["profiles"]] == ["hyclora-4bit-no-logits", "compile"]
    # inductor's CPU kernels among the counted: compiled with kernel profiling on
    assert all(p["launches"] > 0 and any("cpp_fused" in entry["name"] for entry in p["top"])
               for p in check["profiles"])
    assert "kernels launched by one training step" in printed


@pytest.mark.parametrize("keys, message", [
    (["eager", "fast"], "unknown point(s) fast; valid points: " + ", ".join(POINT_KEYS)),
    (["compile"], "the gradients are compared against eager's: add the point eager"),
])
def test_bad_points_are_refused_naming_the_valid_ones(keys, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_points(keys)


def test_a_failing_point_is_reported_and_the_others_still_run(one_layer_workloads, monkeypatch):
    from fxmem_bench import gpu_check
    from fxmem_bench.workloads import get_workload

    real_prepare = gpu_check.prepare_method

    def prepare(workload, method, **kwargs):
        if method == "compile":
            raise RuntimeError("CUDA out of memory")
        return real_prepare(workload, method, **kwargs)

    monkeypatch.setattr(gpu_check, "prepare_method", prepare)
    printed = []
    check = gpu_check.run_gpu_check(get_workload("llama-tiny"), device="cpu", keys=["eager", "compile"],
                                    progress=printed.append)
    assert check.keys == ["eager"] and check.failures == {"compile": "RuntimeError: CUDA out of memory"}
    assert check.to_dict()["failures"] == {"compile": "RuntimeError: CUDA out of memory"}
    assert "torch.compile failed: RuntimeError: CUDA out of memory" in printed
    assert any(line.startswith("eager PEFT: step peak ") and "(reference)" in line for line in printed)


def test_the_block_points_give_the_same_gradients_with_their_inputs_in_host_memory(tiny_workloads):
    from fxmem_bench import gpu_check
    from fxmem_bench.workloads import get_workload

    check = gpu_check.run_gpu_check(get_workload("llama-tiny"), device="cpu", steps=1,
                                    keys=["eager", "hyclora-4bit-blocks", "hyclora-4bit-blocks-offload"])
    on_device, offloaded = check.results[1:]
    assert check.keys[1:] == ["hyclora-4bit-blocks", "hyclora-4bit-blocks-offload"] and not check.failures
    assert offloaded.fidelity.min_cosine == on_device.fidelity.min_cosine >= on_device.fidelity_bound
