import dataclasses
import json
import pathlib
import re

import pytest

from fxmem import cli
from fxmem.config import Config
from fxmem.measure import Fidelity
from fxmem_bench.compare import MethodResult
from fxmem_bench.config_reference import config_reference, field_descriptions
from fxmem_bench.report import PAGE_LIMIT, README_END, README_START, ResultFile, build, claim, with_summary

ROOT = pathlib.Path(__file__).resolve().parents[2]


def result(method: str, samples: list[float], peak: int = 100, cosine: float | None = None,
           bound: float | None = None, budget: float | None = None) -> MethodResult:
    return MethodResult(workload="llama-tiny", method=method, saved_bytes=peak // 2, peak_bytes=peak, static_bytes=1,
                        compile_seconds=0.0, first_loss=1.0, step_samples=samples, budget=budget,
                        fidelity=None if cosine is None else Fidelity(cosine, 0.01, "lora_A", 56),
                        fidelity_bound=bound)


def result_file(tmp_path: pathlib.Path, name: str, command: str, commit: str, results: list[MethodResult],
                **extra: object) -> ResultFile:
    data = {"command": command, "date": "2026-11-26", "machine": "AMD EPYC, 2 cores, torch 2.13.0+cpu",
            "commit": commit, **extra, "results": [r.to_dict() for r in results]}
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return ResultFile(path, data)


def test_the_page_history_and_readme_summary_are_what_the_results_at_the_pages_commit_make(monkeypatch):
    page = (ROOT / "docs/benchmarks.md").read_text()
    commits = re.search(r"measured at fxmem commits? (.+?) \(do not edit", page).group(1).split(", ")
    monkeypatch.chdir(ROOT)
    assert cli.main(["bench", "report", "--commit", *commits, "--check"]) == 0
    assert page.count("\n") <= PAGE_LIMIT
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(README_START) + len(README_START):readme.index(README_END)]
    families = [line for line in block.splitlines() if line.startswith("| ")]
    assert families and all(line in page for line in families)  # the README's table is the page's summary's
    assert "](docs/step-peak-time.png)" in block and (ROOT / "docs/step-peak-time.png").exists()


def test_the_configuration_reference_describes_every_field_and_what_each_preset_sets():
    reference = (ROOT / "docs/config.md").read_text()
    assert reference == config_reference()  # the page's check above holds it to the code
    assert [line[5:-1] for line in reference.splitlines() if line.startswith("### ")] == [
        f.name for f in dataclasses.fields(Config)]
    assert "| `bits` | `None` | `4` | `2` | `8` | `None` |" in reference
    assert "| published worst cosine | 0.9999 | 0.995 | 0.993 | 0.79 | 0.9999 |" in reference


def test_a_field_without_a_description_fails_the_reference(monkeypatch):
    monkeypatch.setattr(Config, "__doc__", Config.__doc__.replace("    strict: any fallback", "    strictly: any"))
    with pytest.raises(ValueError, match="no description for strict; describes what is no field: strictly"):
        field_descriptions()


def test_a_result_file_is_known_by_the_experiment_that_wrote_it():
    def kind(command: str) -> str:
        return ResultFile(pathlib.Path("x.json"), {"command": command}).kind

    assert kind("fxmem bench --workloads llama-tiny --preset hyclora-4bit") == "compare"
    assert kind("fxmem bench compare --workloads llama-tiny") == "compare"
    assert kind("fxmem bench --frontier --workloads llama-tiny") == "frontier"
    assert kind("fxmem bench fidelity --methods eager loract") == "fidelity"
    assert kind("python benchmarks/cuda_check.py --json x.json") == "cuda_check"


def test_a_time_claim_needs_every_round_on_one_side():
    base = result("compile", [1.0, 1.0, 1.0])
    assert claim(result("fxmem", [0.8, 0.9, 0.95]), base) == "0.90x (0.80-0.95), faster"
    assert claim(result("fxmem", [1.1, 1.2, 1.3]), base) == "1.20x (1.10-1.30), slower"
    assert claim(result("fxmem", [0.9, 1.0, 1.1]), base) == "1.00x (0.90-1.10), no claim (the range spans 1)"


def test_the_page_shows_one_commit_and_marks_a_gradient_below_its_bound(tmp_path):
    command = "fxmem bench --workloads llama-tiny --preset hyclora-4bit"
    rows = [result("eager", [2.0, 2.0, 2.0], peak=300), result("compile", [1.0, 1.0, 1.0], peak=200, cosine=1.0),
            result("compile-budget", [1.5, 1.4, 1.6], peak=150, cosine=1.0, budget=0.125),
            result("fxmem", [1.2, 1.1, 1.3], peak=100, cosine=0.98, bound=0.995)]
    current = result_file(tmp_path, "compare-new.json", command, "abc1234", rows, preset="hyclora-4bit")
    older = result_file(tmp_path, "compare-old.json", command, "0ld0000", rows, preset="hyclora-4bit")
    dirty = result_file(tmp_path, "compare-dirty.json", command, "abc1234+", rows, preset="hyclora-4bit")
    report = build([current, older, dirty], ["abc1234"], links_from=tmp_path / "docs",
                   history_path=tmp_path / "benchmarks/history.md", command="fxmem bench report --commit abc1234")
    assert "compare-new.json" in report.page and "compare-old.json" not in report.page
    assert "compare-old.json" in report.history and "compare-dirty.json" in report.history
    assert "(../compare-new.json)" in report.page  # links relative to the page's folder
    assert ("| fxmem | 50 B | 100 B | 0.50x | 1.20x (1.10-1.30) | 0.60x (0.55-0.65) | 0.980000 | 56 | "
            "0.995 (missed) |") in report.page
    assert "| compile-budget 0.125 |" in report.page
    assert "fxmem's gradient on llama-tiny misses its preset's published bound: no claim" in report.page
    # faster in every round, but its gradient misses the bound: the summary claims nothing
    assert ("| llama-tiny | hyclora-4bit | 0.980000 (0.995 (missed)), 56 gradients | compile-budget 0.125 | 0.67x | "
            "0.80x (0.79-0.81), no claim (gradient below its published bound) |") in report.summary
    assert report.summary in report.page
    with pytest.raises(ValueError, match="measured at commit 'fffffff'; commits with one: 0ld0000, abc1234$"):
        build([current, older, dirty], ["fffffff"], links_from=tmp_path, history_path=tmp_path / "h.md",
              command="report")
    # a longer hash names the same commit; a file missing what its table needs is refused by name
    assert build([current], ["abc1234def"], links_from=tmp_path, history_path=tmp_path / "h.md",
                 command="report").page == build([current], ["abc1234"], links_from=tmp_path,
                                                 history_path=tmp_path / "h.md", command="report").page
    del current.data["results"][0]["step_samples"]
    with pytest.raises(ValueError, match="compare-new.json: not a complete compare result .KeyError"):
        build([current], ["abc1234"], links_from=tmp_path, history_path=tmp_path / "h.md", command="report")


def test_a_workload_measured_at_two_commits_is_summarized_from_the_later_one(tmp_path):
    command = "fxmem bench compare --workloads llama-tiny --preset hyclora-4bit"
    files = [result_file(tmp_path, f"compare-{commit}.json", command, commit,
                         [result("eager", [2.0, 2.0, 2.0]), result("fxmem", [1.0, 1.0, 1.0], cosine=cosine, bound=0.995)],
                         preset="hyclora-4bit") for commit, cosine in (("aaaaaaa", 0.996), ("bbbbbbb", 0.9999))]
    for commits, shown in ((["aaaaaaa", "bbbbbbb"], "0.999900"), (["bbbbbbb", "aaaaaaa"], "0.996000")):
        report = build(files, commits, links_from=tmp_path, history_path=tmp_path / "h.md", command="report")
        assert report.summary.count("| llama-tiny |") == 1 and f"| {shown} (0.995)" in report.summary
        assert "compare-aaaaaaa.json" in report.page and "compare-bbbbbbb.json" in report.page  # both sections


def test_a_cosine_that_did_not_count_its_gradients_is_refused(tmp_path):
    rows = [result("eager", [2.0, 2.0, 2.0]), result("fxmem", [1.0, 1.0, 1.0], cosine=0.99999, bound=0.995)]
    file = result_file(tmp_path, "compare-old-format.json", "fxmem bench --workloads llama-tiny", "abc1234", rows)
    del file.data["results"][1]["fidelity"]["compared"]  # as written before gradient_fidelity counted
    with pytest.raises(ValueError, match="compare-old-format.json: not a complete compare result .KeyError: "
                                         ".compared: the count of gradients compared"):
        build([file], ["abc1234"], links_from=tmp_path, history_path=tmp_path / "h.md", command="report")


def test_the_readme_summary_goes_between_its_markers_only():
    readme = f"intro\n{README_START}\nold figures\n{README_END}\nrest\n"
    assert with_summary(readme, "| new |") == f"intro\n{README_START}\n| new |\n{README_END}\nrest\n"
    with pytest.raises(ValueError, match="the README has no block to write: add the lines"):
        with_summary("no markers here", "| new |")


def test_a_context_result_is_tabled_against_the_baseline_that_fits_the_most_tokens(tmp_path):
    from fxmem.fitting import Probe
    from fxmem_bench.context import ContextResult

    def context(method, longest, per_token, cosine=None, bound=None):
        return ContextResult("llama-small", method, 3 << 29, longest, longest + 128,
                             [Probe(longest, 100, 50)], per_token,
                             None if cosine is None else Fidelity(cosine, 0.01, "lora_A", 112), bound)

    results = [context("compile-checkpointing", 2048, 1.0), context("compile-checkpointing-lce", 4096, 1.2),
               context("fxmem hyclora-4bit", 12288, 1.8, 0.9991, 0.995)]
    command = "fxmem bench context --workload llama-small --memory-cap 1.5GiB"
    file = result_file(tmp_path, "context.json", command, "abc1234", [], memory_cap=3 << 29)
    file.data["results"] = [r.to_dict() for r in results]
    report = build([file], ["abc1234"], links_from=tmp_path, history_path=tmp_path / "h.md", command="report")
    assert "## Tokens that fit: llama-small under 1.50 GiB" in report.page
    assert "| fxmem hyclora-4bit | 12,288 | 3.00x | 1.50x | 12,416 | 0.999100 | 112 | 0.995 |" in report.page
    assert ("| llama-small | 1.50 GiB | hyclora-4bit | 12,288 | compile-checkpointing-lce 4,096 | 3.00x | 1.50x | "
            "0.999100 (0.995), 112 gradients |") in report.summary


def test_exact_in_bf16_is_held_to_bf16_rounding_measured_by_eager_not_to_fp32s_bound(tmp_path):
    def fidelity(method, same, fp32):
        comparison = {"same_dtype": {"min_cosine": same, "median_relative_error": 0.01, "worst_parameter": "lora_A",
                                     "compared": 28, "zero_in_reference": 0},
                      "fp32": {"min_cosine": fp32, "median_relative_error": 0.01, "worst_parameter": "lora_A",
                               "compared": 28, "zero_in_reference": 0}, "steps": 0, "per_parameter": {}}
        return {"method": method, "dtype": "bfloat16", "saved_bytes": 1 << 20, "comparisons": [comparison]}

    command = "fxmem bench fidelity --workload llama3-bf16-small --tokens random"
    file = result_file(tmp_path, "fidelity.json", command, "abc1234", [], workload="llama3-bf16-small",
                       tokens="random")
    file.data["results"] = [fidelity("eager", 1.0, 0.9998), fidelity("exact", 0.9998, 0.99986),
                            fidelity("runlora", 0.9990, 0.9990), fidelity("hyclora-4bit", 0.9923, 0.9923)]
    report = build([file], ["abc1234"], links_from=tmp_path, history_path=tmp_path / "h.md", command="report")
    # below fp32's 0.9999, yet as close to fp32 eager as eager bf16 itself (0.9998): met
    assert ("| llama3-bf16-small | random token ids | exact | bfloat16 | 0.9998 | bfloat16 rounding: 0.9996 vs fp32 "
            "| 28 |") in report.summary
    assert ("| runlora | bfloat16 | 1.00 MiB | 0.9990 | 28 | lora_A | 0.9990 | bfloat16 rounding: 0.9996 vs fp32 "
            "(missed) |") in report.page
    assert "| hyclora-4bit | bfloat16 | 0.9923 | 0.995 (missed) | 28 |" in report.summary


def test_families_are_tabled_per_dtype_against_llamas_reduction_and_join_a_page_of_another_commit(tmp_path):
    def coverage(family, dtype, preset, cosine, reduction):
        return {"family": family, "dtype": dtype, "preset": preset, "eager_bytes": 1000,
                "saved_bytes": int(1000 / reduction), "planned_bytes": int(1000 / reduction), "reduction": reduction,
                "fidelity": {"min_cosine": cosine, "median_relative_error": 0.01, "worst_parameter": "lora_A",
                             "compared": 28, "zero_in_reference": 0}, "kept_by_reason": {}, "steps": 0,
                "trained_fidelity": None}

    results = [coverage("llama", "fp32", "exact", 1.0, 1.5), coverage("llama", "fp32", "hyclora-4bit", 0.997, 8.0),
               coverage("gemma2", "fp32", "exact", 1.0, 1.2), coverage("gemma2", "fp32", "hyclora-4bit", 0.99, 6.0)]
    file = result_file(tmp_path, "coverage.json", "fxmem bench coverage --dtypes fp32", "def5678", [])
    file.data["results"] = results
    rows = [result("eager", [2.0, 2.0, 2.0]), result("fxmem", [1.0, 1.0, 1.0], cosine=0.999, bound=0.995)]
    compare = result_file(tmp_path, "compare.json", "fxmem bench --workloads llama-tiny", "abc1234", rows)
    report = build([compare, file], ["abc1234", "def5678"], links_from=tmp_path, history_path=tmp_path / "h.md",
                   command="report")
    assert "measured at fxmem commits abc1234, def5678 (do not edit" in report.page
    assert "## Model families: saved bytes and gradients" in report.page and "fxmem at def5678" in report.page
    assert "| gemma2 | fp32 | 1000 B | 1.0000, 1.20x (80% of llama's) | 0.9900 (missed), 6.00x (75% of llama's) |" \
        in report.page
    assert "| gemma2 | 0.9900 (missed), 6.00x |" in report.summary  # the lossy presets, in the README
    with pytest.raises(ValueError, match="measured at commit 'fffffff'"):
        build([compare, file], ["abc1234", "fffffff"], links_from=tmp_path, history_path=tmp_path / "h.md",
              command="report")
    # a later commit's coverage supersedes the earlier one's rows in the README's summary, family by family
    later = result_file(tmp_path, "coverage-later.json", "fxmem bench coverage --dtypes fp32", "0123abc", [])
    later.data["results"] = [coverage("gemma2", "fp32", "hyclora-4bit", 0.999, 11.0)]
    report = build([compare, file, later], ["abc1234", "def5678", "0123abc"], links_from=tmp_path,
                   history_path=tmp_path / "h.md", command="report")
    assert "| gemma2 | 0.9990, 11.00x |" in report.summary and "| gemma2 | 0.9900" not in report.summary
    assert "| llama | 0.9970, 8.00x |" in report.summary  # measured by the earlier commit alone
    # a newer file of another dtype hides none of the older one's cells: one table, a column per dtype
    later.data["results"] = [coverage("gemma2", "bf16", "hyclora-4bit", 0.999, 11.0)]
    report = build([compare, file, later], ["abc1234", "def5678", "0123abc"], links_from=tmp_path,
                   history_path=tmp_path / "h.md", command="report")
    table = ["| family | hyclora-4bit, bf16 | hyclora-4bit, fp32 |", "|---|---|---|",
             "| gemma2 | 0.9990, 11.00x | 0.9900 (missed), 6.00x |", "| llama | — | 0.9970, 8.00x |"]
    assert "\n".join(table) in report.summary and "\n".join(table) in report.readme


def test_the_figure_plots_every_method_against_torch_compile_and_check_finds_it_stale(tmp_path, monkeypatch):
    from fxmem_bench.figure import digest, recorded_digest

    results = [result("compile", [1.0, 1.0, 1.0], peak=200), result("eager", [1.2, 1.3, 1.1], peak=220),
               result("fxmem", [1.1, 1.2, 1.15], peak=50, cosine=0.999, bound=0.995)]
    folder = tmp_path / "results"
    folder.mkdir()
    result_file(folder, "compare.json", "fxmem bench compare --workloads llama-tiny", "abcdef1", results,
                preset="hyclora-4bit")
    report = build([ResultFile(folder / "compare.json", json.loads((folder / "compare.json").read_text()))],
                   ["abcdef1"], links_from=tmp_path, history_path=tmp_path / "history.md", command="report")
    (panel,) = report.panels
    assert [(p.label, p.peak, p.time, p.time_low, p.time_high, p.is_fxmem) for p in panel.points] == [
        ("compile", 1.0, 1.0, 1.0, 1.0, False), ("eager", 1.1, 1.2, 1.1, 1.3, False),
        ("fxmem", 0.25, 1.15, 1.1, 1.2, True)]
    assert panel.title == "llama-tiny: fxmem hyclora-4bit, worst grad cos 0.9990 over 56 gradients (bound 0.995)"
    assert report.readme.startswith("![Step peak against step time")
    readme, figure = tmp_path / "README.md", tmp_path / "figure.png"
    readme.write_text(f"{README_START}\n{README_END}\n")
    arguments = ["bench", "report", "--commit", "abcdef1", "--results", str(folder), "--page", str(tmp_path / "b.md"),
                 "--history", str(tmp_path / "h.md"), "--readme", str(readme), "--config-reference",
                 str(tmp_path / "c.md"), "--figure", str(figure)]
    assert cli.main(arguments) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and recorded_digest(figure) == digest(report.panels)
    assert "![Step peak against step time of every method, as ratios to torch.compile's](figure.png)" in (
        readme.read_text())
    assert cli.main([*arguments, "--check"]) == 0
    results[2].peak_bytes = 60  # a new result: the figure no longer plots it
    result_file(folder, "compare.json", "fxmem bench compare --workloads llama-tiny", "abcdef1", results,
                preset="hyclora-4bit")
    assert cli.main([*arguments, "--check"]) == 1
