import argparse
import dataclasses
import json
import math

import pytest
import torch

from fxmem import cli
from fxmem.cli.common import byte_size
from fxmem.config import PUBLISHED_MIN_COSINE, Config
from fxmem.fitting import MAX_GROWTH, MAX_PROBES, Probe, longest_fitting
from fxmem.measure import gradient_fidelity
from fxmem_bench.cli.context import COLUMNS, rows
from fxmem_bench.context import ContextResult, default_baselines, first_step, measure_length, run_context
from tests.bench.conftest import TINY_LLAMA

ONE_LAYER = dataclasses.replace(TINY_LLAMA, llama=dataclasses.replace(TINY_LLAMA.llama, layers=1))
MiB = 2**20


def synthetic(peak_per_token: float, static: int, quadratic: float = 0.0):
    measured = []

    def measure(seq: int) -> Probe:
        measured.append(seq)
        return Probe(seq, int(peak_per_token * seq + quadratic * seq * seq), static)
    return measure, measured


def truth(peak_per_token: float, static: int, cap: int, granularity: int, quadratic: float = 0.0) -> int:
    seq = 0
    while static + peak_per_token * (seq + granularity) + quadratic * (seq + granularity) ** 2 <= cap:
        seq += granularity
    return seq


@pytest.mark.parametrize(("per_token", "quadratic", "start"),
                         [(1000.0, 0.0, 512), (300.0, 0.0, 512), (200.0, 0.05, 512), (5000.0, 0.0, 512),
                          (20000.0, 0.0, 4096)])
def test_search_brackets_the_longest_fitting_length(per_token, quadratic, start):
    cap, static, granularity = 64 * MiB, 20 * MiB, 128
    measure, measured = synthetic(per_token, static, quadratic)
    fit = longest_fitting(measure, cap, start=start, granularity=granularity, max_seq=1 << 20)
    assert fit.longest == truth(per_token, static, cap, granularity, quadratic)
    assert fit.shortest_failing == fit.longest + granularity and fit.converged
    assert len(set(measured)) == len(measured)  # no length measured twice
    if quadratic == 0.0:  # a line: right from its second point, once no longer held back by MAX_GROWTH
        assert len(fit.probes) <= 3 + math.ceil(math.log(max(fit.longest, start) / start, MAX_GROWTH))


def test_search_on_peaks_no_line_predicts_keeps_a_true_bracket_and_says_when_it_stopped_short():
    def staircase(seq: int) -> Probe:  # flat, then a jump of 16 MiB every 4096 tokens
        return Probe(seq, (seq // 4096) * 16 * MiB + seq, 0)
    fit = longest_fitting(staircase, 40 * MiB, start=512, granularity=128, max_seq=1 << 20)
    assert staircase(fit.longest).fits(40 * MiB) and not staircase(fit.shortest_failing).fits(40 * MiB)
    assert fit.longest <= 12288 - 128 < fit.shortest_failing
    assert fit.converged == (fit.shortest_failing - fit.longest == 128)
    measure, _ = synthetic(1.0, 0, quadratic=0.5)
    fit = longest_fitting(measure, 64 * MiB, start=16, granularity=1, max_seq=1 << 20)
    assert len(fit.probes) == MAX_PROBES and not fit.converged


def test_search_treats_running_out_of_device_memory_as_not_fitting():
    def measure(seq: int) -> Probe:
        return Probe(seq, 0, 0, out_of_memory=True) if seq > 3000 else Probe(seq, seq * 1000, 0)
    fit = longest_fitting(measure, 64 * MiB, start=512, granularity=128, max_seq=1 << 20)
    assert (fit.longest, fit.shortest_failing) == (2944, 3072) and fit.converged
    assert max(p.seq for p in fit.probes) <= MAX_GROWTH * 2944


def test_search_stops_at_max_seq_and_when_nothing_fits():
    measure, _ = synthetic(10.0, 1 * MiB)
    fit = longest_fitting(measure, 64 * MiB, start=512, granularity=128, max_seq=4100)  # rounded down to 4096
    assert (fit.longest, fit.shortest_failing, fit.converged) == (4096, None, True)
    measure, _ = synthetic(10.0, 65 * MiB)
    fit = longest_fitting(measure, 64 * MiB, start=512, granularity=128, max_seq=4096)
    assert (fit.longest, fit.shortest_failing) == (0, 128)
    with pytest.raises(ValueError, match="positive multiple of granularity"):
        longest_fitting(measure, 64 * MiB, start=500, granularity=128, max_seq=4096)
    with pytest.raises(ValueError, match="is below start"):
        longest_fitting(measure, 64 * MiB, start=512, granularity=128, max_seq=500)


def test_each_longest_length_is_measured_to_fit_and_the_next_not():
    # a cap between what 256 and 512 tokens take (2.6 and 4.7 MiB eager, 2.2 and 4.3 MiB exact): two lengths each,
    # the second a compile of its own; the search's own steps are the synthetic tests' above
    cap = int(3.5 * MiB)
    eager, exact = run_context(ONE_LAYER, cap, presets=("exact",), baselines=("eager",), start=256, granularity=256)
    for result in (eager, exact):
        failing = next(p for p in result.probes if p.seq == result.shortest_failing)
        assert result.at_longest.total_bytes <= cap < failing.total_bytes
        assert result.shortest_failing - result.longest == 256
        assert result.seconds_per_token > 0
        assert ContextResult.from_dict(result.to_dict()) == result
    assert eager.fidelity is None
    # against eager's gradients at fxmem's own longest length, with the preset's published bound beside them
    assert exact.fidelity.min_cosine > 0.99999 and exact.fidelity_bound == PUBLISHED_MIN_COSINE["exact"]


def test_bench_context_command_prints_and_writes_its_results(one_layer_workloads, tmp_path, capsys):
    path = tmp_path / "context.json"
    assert cli.main(["bench", "context", "--workload", "llama-tiny", "--memory-cap", "3.5MiB", "--baselines", "eager",
                     "--presets", "--start", "256", "--granularity", "64", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "longest fitting" in out and "under 3.50 MiB" in out
    [result] = json.loads(path.read_text())["results"]
    assert result["method"] == "eager" and result["longest"] % 64 == 0 and result["longest"] > 0
    assert cli.main(["bench", "context", "--memory-cap", "1GiB", "--start", "500"]) == 2
    assert "multiple of --granularity" in capsys.readouterr().out


def test_unknown_baselines_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid baselines: eager, compile, compile-budget, compile-checkpointing, "
                                         "compile-checkpointing-lce, compile-checkpointing-liger"):
        run_context(ONE_LAYER, MiB, presets=(), baselines=("hf-checkpointing",))


def test_default_baselines_are_those_that_run_on_the_device_and_the_cuda_ones_are_refused_on_a_cpu(capsys):
    assert default_baselines("cpu") == ("eager", "compile", "compile-budget", "compile-checkpointing",
                                        "compile-checkpointing-lce")
    assert "compile-checkpointing-offload" in default_baselines("cuda")  # transformers >= its offload option
    with pytest.raises(ValueError, match=r"compile-checkpointing-offload runs on CUDA only .*got device cpu"):
        run_context(ONE_LAYER, MiB, presets=(), baselines=("compile-checkpointing-offload",))
    assert cli.main(["bench", "context", "--memory-cap", "1GiB", "--baselines", "compile-checkpointing-liger",
                     "--presets", "--device", "cpu"]) == 2
    assert "compile-checkpointing-liger runs on CUDA only" in capsys.readouterr().out


def test_linear_cross_entropy_baseline_is_measured_at_a_length_as_every_baseline(monkeypatch):
    # compiled without inductor's code generation (seconds, not a minute): the method's own graphs
    compile_with = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: compile_with(model, **{"backend": "aot_eager",
                                                                                         **options}))
    device = torch.device("cpu")
    eager = first_step(ONE_LAYER, "eager", 64, config=Config(), device=device, lora_rank=16)
    chunked = measure_length(ONE_LAYER, "compile-checkpointing-lce", 64, config=Config(), device=device, lora_rank=16)
    assert chunked.probe.seq == 64 and chunked.probe.peak_bytes > 0 and chunked.probe.static_bytes > 0
    assert gradient_fidelity(eager.grads, chunked.grads).min_cosine > 0.99999


def test_table_compares_with_the_best_baseline():
    def result(method: str, longest: int, seconds: float) -> ContextResult:
        return ContextResult("w", method, 10 * MiB, longest, longest + 64,
                             [Probe(longest, MiB, MiB), Probe(longest + 64, 20 * MiB, MiB)], seconds)
    table = rows([result("eager", 256, 2.0), result("compile", 512, 1.0), result("fxmem exact", 1536, 1.5)])
    assert all(len(row) == len(COLUMNS) for row in table)
    assert [row[2] for row in table] == ["0.50x", "1.00x", "3.00x"]
    assert [row[7] for row in table] == ["2.00x", "1.00x", "1.50x"]
    assert table[2][4:6] == ["1,600", "21.00 MiB"]


@pytest.mark.parametrize(("text", "expected"), [("2GiB", 2 * 2**30), ("1.5 GiB", 3 * 2**29), ("512MiB", 512 * MiB),
                                                ("4096", 4096)])
def test_memory_sizes_parse_with_their_units(text, expected):
    assert byte_size(text) == expected


def test_bad_memory_sizes_name_the_units():
    with pytest.raises(argparse.ArgumentTypeError, match="B, KiB, MiB, GiB, TiB"):
        byte_size("2GB")



def test_options_set_on_the_presets_are_checked_before_anything_runs():
    with pytest.raises(ValueError, match="mlp_chunk must be an integer number of tokens >= 1"):
        run_context(ONE_LAYER, MiB, presets=("exact",), baselines=("eager",), options={"mlp_chunk": 0})
