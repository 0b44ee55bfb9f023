"""`fxmem bench report`: docs/benchmarks.md written from the result files of chosen commits, and a history apart.

The page holds every result file (benchmarks/results/*.json, as `--json` writes them) whose fxmem commit is one of
the chosen ones, each as its table with the command that makes it, the machine and the date; the README's figures are
the page's summary, written between two markers. Every other result file goes to the history, newest first. A
file whose commit carries a '+' ran with uncommitted changes: it is history whatever its commit.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fxmem.config import PUBLISHED_MIN_COSINE
from fxmem.fidelity import short_name
from fxmem.measure import format_bytes
from fxmem.timing import round_ratio
from fxmem_bench.compare import MethodResult
from fxmem_bench.context import ContextResult
from fxmem_bench.figure import Panel, panel
from fxmem_bench.frontier import wins

README_START = "<!-- fxmem bench report: start -->"
README_END = "<!-- fxmem bench report: end -->"
PAGE_LIMIT = 300  # lines: one page a reader reads


@dataclass(frozen=True)
class ResultFile:
    """One `--json` output: where it comes from, and its results."""

    path: pathlib.Path
    data: dict[str, Any]

    @property
    def command(self) -> str:
        """The command line that wrote it ('' where not recorded)."""
        return self.data.get("command") or ""

    @property
    def commit(self) -> str:
        """fxmem's commit when it ran ('+': with uncommitted changes)."""
        return self.data.get("commit") or "unknown"

    @property
    def date(self) -> str:
        return self.data.get("date") or "unknown"

    @property
    def machine(self) -> str:
        return self.data.get("machine") or "unknown machine"

    @property
    def kind(self) -> str:
        """The experiment that wrote it: the subcommand of `fxmem bench` (compare when none is named), frontier for
        `compare --frontier`; a script's name otherwise."""
        words = shlex.split(self.command)
        if words[:2] != ["fxmem", "bench"]:
            return pathlib.Path(words[1]).stem if words[:1] == ["python"] and len(words) > 1 else "other"
        if len(words) > 2 and not words[2].startswith("-") and words[2] != "compare":
            return words[2]
        return "frontier" if "--frontier" in words else "compare"

    @property
    def results(self) -> list[dict[str, Any]]:
        return self.data.get("results") or []


def load_results(directory: pathlib.Path) -> list[ResultFile]:
    """Every result file in ``directory``, by name."""
    files = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text())
        files.append(ResultFile(path, data if isinstance(data, dict) else {"results": data}))
    return files


@dataclass(frozen=True)
class Report:
    """What `fxmem bench report` writes."""

    page: str  # docs/benchmarks.md
    history: str  # the history file
    summary: str  # the page's summary
    readme: str  # the README's block, between README_START and README_END: the figure, then the families
    panels: tuple[Panel, ...]  # the figure's


def build(files: Sequence[ResultFile], commits: Sequence[str], *, links_from: pathlib.Path,
          history_path: pathlib.Path, command: str, figure_link: str = "docs/step-peak-time.png") -> Report:
    """The page of the result files of ``commits`` (links relative to ``links_from``, the page's folder), the
    history of the others, the page's summary and the README's block (the figure at ``figure_link`` and the
    families). Each section says its commit: an experiment rerun at a later
    commit (a change that moves only its figures) joins the page without rerunning the others.

    Raises ValueError when no renderable result file has one of those commits, naming the commits that have one."""
    if isinstance(commits, str):
        raise TypeError(f"commits: a sequence of commits, not one string ({commits!r}: pass [{commits!r}])")
    on_page = []
    for asked in commits:
        found = [f for f in files if _same_commit(f.commit, asked) and f.kind in RENDERERS]
        if not found:
            known = sorted({f.commit for f in files if f.kind in RENDERERS and not f.commit.endswith("+")})
            raise ValueError(f"no result file of a kind the page shows ({', '.join(RENDERERS)}) was measured at "
                             f"commit {asked!r}; commits with one: {', '.join(known) or 'none'}")
        on_page += [f for f in found if f not in on_page]
    on_page.sort(key=lambda f: (list(RENDERERS).index(f.kind), f.path.name))
    rank = {f.path: i for i, asked in enumerate(commits) for f in on_page if _same_commit(f.commit, asked)}
    # in the order asked, oldest first: a later commit's figures supersede an earlier one's in the summary
    commit = ", ".join(dict.fromkeys(f.commit for f in sorted(on_page, key=lambda f: rank[f.path])))
    sections = [_rendered(f) for f in on_page]
    newest_first = sorted(on_page, key=lambda f: -rank[f.path])
    summary = _summary(newest_first)
    panels = tuple(_panels(newest_first))
    machines = sorted({f.machine for f in on_page})
    lines = ["# Benchmarks", "",
             (f"Written by `{command}` from the result files in benchmarks/results/ measured at fxmem "
             f"commit{'s' if ',' in commit else ''} {commit} (do not edit by hand: rerun the commands below, then the report). Older results: "
             f"[{history_path.name}]({relative_link(history_path, links_from)})."), "",
             f"Machine{'s' if len(machines) > 1 else ''}: {'; '.join(machines)}.", "", *_HOW_TO_READ, "",
             "## Summary", "", *summary, ""]
    for file, section in zip(on_page, sections, strict=True):
        lines += [f"## {RENDERERS[file.kind].title(file)}", "", f"Command: `{file.command}`", "",
                  (f"{file.date}, {file.machine}, fxmem at {file.commit}; results: "
                  f"[{file.path.name}]({relative_link(file.path, links_from)})."), "",
                  *section, ""]
    history = ["# Benchmark history", "",
               (f"Every result file in benchmarks/results/ not on the current page ([benchmarks.md]"
               f"({relative_link(links_from / 'benchmarks.md', history_path.parent)}), commit{'s' if ',' in commit else ''} "
               f"{commit}), newest first, "
               "with the command that wrote it and where and when it ran. A commit with '+' ran with uncommitted "
               "changes. The pages written by hand before the report, with the tables of these runs and what each "
               "change was for, are beside this file."), "",
               *_table(("file", "date", "commit", "machine", "command"),
                       [[f"[{f.path.name}]({relative_link(f.path, history_path.parent)})", f.date, f.commit, f.machine,
                         f"`{f.command}`" if f.command else "(not recorded)"] for f in _newest_first(files, on_page)])]
    return Report(page="\n".join(lines).rstrip() + "\n", history="\n".join(history).rstrip() + "\n",
                  summary="\n".join(summary), readme="\n".join(_readme_block(newest_first, panels, figure_link)),
                  panels=panels)


def _same_commit(recorded: str, asked: str) -> bool:
    """A clean recorded commit that ``asked`` names, in full or by a prefix of at least 7 characters."""
    return (not recorded.endswith("+") and len(asked) >= 7 and len(recorded) >= 7
            and (recorded.startswith(asked) or asked.startswith(recorded)))


def _newest_first(files: Sequence[ResultFile], shown: Sequence[ResultFile]) -> list[ResultFile]:
    """The files not ``shown``, newest date first, by name within a date; those with no date last."""
    rest = sorted((f for f in files if f not in shown), key=lambda f: f.path.name)
    return sorted(rest, key=lambda f: f.date if f.date != "unknown" else "", reverse=True)


def _rendered(file: ResultFile) -> list[str]:
    """The file's tables; a file that lacks what its kind's table needs is refused by name."""
    try:
        return RENDERERS[file.kind].render(file)
    except (KeyError, TypeError, IndexError, StopIteration) as error:
        raise ValueError(f"{file.path.name}: not a complete {file.kind} result ({type(error).__name__}: {error}); "
                         "rerun its command, or leave it out of the page's commit") from error


def with_summary(readme: str, summary: str) -> str:
    """``readme`` with the text between its two report markers replaced by ``summary`` (the README's block)."""
    start, end = readme.find(README_START), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no block to write: add the lines {README_START!r} and {README_END!r} "
                         "where the benchmark summary goes")
    return readme[:start + len(README_START)] + "\n" + summary + "\n" + readme[end:]


_HOW_TO_READ = [
    ("How to read the tables: every method of a table ran in one process, its steps timed in interleaved rounds. "
    "A time ratio is the median of the per-round ratios, with the rounds' min-max in parentheses; a claim that "
    "one method is faster is made only where the range lies wholly on one side of 1. Step peak: a full training "
    "step's peak allocation above what was allocated when it began (CPU: the profiler's allocation events; "
    "CUDA: allocator statistics). Saved activations: the storages autograd holds for backward, each counted "
    "once at its full size, measured the same way for every method. Gradient cosine: the lowest cosine of any "
    "trainable gradient against eager PEFT's on the same batch and weights, every one compared (LoRA B is drawn "
    "past its zero init, so that A's gradients are not zero; a figure over a zero gradient is refused); an fxmem "
    "row must meet its "
    "preset's published bound (marked \"missed\" where it does not, and then no claim is made for it; —: an "
    "exact method, held to none).")]


def relative_link(path: pathlib.Path, start: pathlib.Path) -> str:
    """``path`` as a markdown link from the folder ``start``."""
    return pathlib.Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def _method_results(file: ResultFile) -> list[MethodResult]:
    return [MethodResult.from_dict(r) for r in file.results]


def _cosine(result: MethodResult) -> str:
    return f"{result.fidelity.min_cosine:.6f}" if result.fidelity else "(reference)"


def _compared(result: MethodResult) -> str:
    """How many gradients the figure compared; a result that did not count them (written before gradient_fidelity
    refused zero gradients) is refused, since its cosine may count LoRA A's zeros against zeros as 1."""
    if result.fidelity is None:
        return "—"
    return str(_count(result.fidelity.to_dict()))


def _count(fidelity: dict[str, Any]) -> int:
    if fidelity.get("compared") is None:
        raise KeyError("compared: the count of gradients compared (a result written before it was kept, whose "
                       "cosine may count zero gradients as 1)")
    return fidelity["compared"]


def _bound(result: MethodResult) -> str:
    if result.fidelity_bound is None:
        return "—"
    return f"{result.fidelity_bound:g}" + ("" if result.meets_fidelity_bound else " (missed)")


def _label(result: MethodResult) -> str:
    if result.method == "compile-budget" and result.budget is not None:
        return f"compile-budget {result.budget:.3g}"
    return result.label or result.method


def _by_workload(results: Sequence[MethodResult]) -> dict[str, list[MethodResult]]:
    grouped: dict[str, list[MethodResult]] = {}
    for r in results:
        grouped.setdefault(r.workload, []).append(r)
    return grouped


def _table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *("| " + " | ".join(row) + " |" for row in rows)]


def claim(ours: MethodResult, theirs: MethodResult) -> str:
    """``ours``'s step time against ``theirs``, and what the rounds let one say of it."""
    ratio = round_ratio(ours.step_samples, theirs.step_samples)
    if round(ratio.high, 2) < 1:  # as printed: a claim never contradicts its own figures
        return f"{ratio}, faster"
    if round(ratio.low, 2) > 1:
        return f"{ratio}, slower"
    return f"{ratio}, no claim (the range spans 1)"


# compare ------------------------------------------------------------------------------------------------------

def _workloads(file: ResultFile) -> str:
    return ", ".join(dict.fromkeys(r["workload"] for r in file.results))


def _compare_title(file: ResultFile) -> str:
    return f"fxmem against every baseline: {_workloads(file)}, {file.data.get('preset', 'exact')}"


def _compare(file: ResultFile) -> list[str]:
    lines = []
    for workload, results in _by_workload(_method_results(file)).items():
        compiled = next((r for r in results if r.method == "compile"), None)
        eager = next((r for r in results if r.method == "eager"), None)
        rows = [[_label(r), format_bytes(r.saved_bytes), format_bytes(r.peak_bytes),
                 f"{r.peak_bytes / compiled.peak_bytes:.2f}x" if compiled else "—",
                 str(round_ratio(r.step_samples, compiled.step_samples)) if compiled else "—",
                 str(round_ratio(r.step_samples, eager.step_samples)) if eager else "—",
                 _cosine(r), _compared(r), _bound(r)] for r in results]
        lines += [f"{workload}:", "", *_table(("method", "saved activations", "step peak", "peak vs compile",
                                               "step vs compile", "step vs eager", "min grad cos",
                                               "gradients compared", "published bound"), rows), ""]
        ours = next((r for r in results if r.method == "fxmem"), None)
        if ours and not ours.meets_fidelity_bound:
            lines += [(f"fxmem's gradient on {workload} misses its preset's published bound: no claim of this "
                      "table stands for it."), ""]
    return lines


def _summary(files: Sequence[ResultFile]) -> list[str]:
    """fxmem against each baseline of each compare table, and each preset's gradient fidelity: the README's
    figures. ``files`` newest commit first: a workload (and a fidelity batch) measured at several commits is
    summarized from the newest; the page keeps each file's section."""
    rows = []
    summarized: set[tuple[str, ...]] = set()
    for workload, preset, results in _newest_compares(files):
        ours = next(r for r in results if r.method == "fxmem")
        time = claim if ours.meets_fidelity_bound else _no_claim
        rows += [[workload, preset, f"{_cosine(ours)} ({_bound(ours)}), {_compared(ours)} gradients", _label(theirs),
                  f"{ours.peak_bytes / theirs.peak_bytes:.2f}x", time(ours, theirs)]
                 for theirs in results if theirs is not ours]
    lines = _table(("workload", "fxmem preset", "fxmem's min grad cos (published bound)", "against",
                    "step peak: fxmem / theirs", "step time: fxmem / theirs"), rows) if rows else [
        "(no compare table at this commit)"]
    fidelity = []
    for file in (f for f in files if f.kind == "fidelity"):
        batch = (file.data.get("workload", ""), file.data.get("tokens", ""))
        if ("fidelity", *batch) in summarized:
            continue
        summarized.add(("fidelity", *batch))
        fidelity += [[batch[0], "random token ids" if batch[1] == "random" else "real text", r["method"],
                      r.get("dtype", ""), *_cosine_and_bound(r, file), str(_count(r["comparisons"][0]["same_dtype"]))]
                     for r in file.results if r["method"] in PUBLISHED_MIN_COSINE]
    if fidelity:
        lines += ["", *_table(("workload", "batch", "fxmem preset", "dtype", "min grad cos vs eager, same dtype",
                               "published bound", "gradients compared"), fidelity)]
    if context := _context_summary(files):
        lines += ["", *context]
    if families := _coverage_summary(files):
        lines += ["", *families]
    return lines


def _newest_compares(files: Sequence[ResultFile]) -> list[tuple[str, str, list[MethodResult]]]:
    """(workload, preset, results) of every compare table with an fxmem row, each workload and preset from the
    newest file (``files`` newest first) that measured it."""
    found: dict[tuple[str, str], list[MethodResult]] = {}
    for file in (f for f in files if f.kind == "compare"):
        preset = file.data.get("preset", "exact")
        for workload, results in _by_workload(_method_results(file)).items():
            if any(r.method == "fxmem" for r in results):
                found.setdefault((workload, preset), results)
    return [(workload, preset, results) for (workload, preset), results in found.items()]


def _panels(files: Sequence[ResultFile]) -> list[Panel]:
    return [p for workload, preset, results in _newest_compares(files)
            if (p := panel(workload, preset, results, _label)) is not None]


def _readme_block(files: Sequence[ResultFile], panels: Sequence[Panel], figure_link: str) -> list[str]:
    """The README's figures: the step-peak/step-time figure, then every family's worst cosine and bytes."""
    lines = []
    if panels:
        lines += [f"![Step peak against step time of every method, as ratios to torch.compile's]({figure_link})", "",
                  ("Every method of `fxmem bench compare` on "
                   f"{', '.join(p.workload for p in panels)} (LoRA on every linear, B past init, real text), in one "
                   "process with interleaved rounds; both axes are ratios to torch.compile's; fxmem's worst gradient "
                   "cosine against eager is in each title. The tables: [docs/benchmarks.md](docs/benchmarks.md)."),
                  ""]
    if families := _coverage_summary(files):
        lines += [("Supported families (`fxmem bench coverage`: a tiny config of each, LoRA on every linear, B past "
                   "init, real text). Each cell: the worst LoRA-gradient cosine against eager PEFT, then eager's "
                   "saved bytes over fxmem's; (missed): below the preset's published bound."), "", *families]
    return lines


def _no_claim(ours: MethodResult, theirs: MethodResult) -> str:
    return f"{round_ratio(ours.step_samples, theirs.step_samples)}, no claim (gradient below its published bound)"


# frontier -----------------------------------------------------------------------------------------------------

def _frontier_title(file: ResultFile) -> str:
    return f"Memory/time frontier: {_workloads(file)}"


def _frontier(file: ResultFile) -> list[str]:
    lines = []
    for workload, results in _by_workload(_method_results(file)).items():
        compiled = next(r for r in results if r.method == "compile")
        rows = [[_label(r), format_bytes(r.saved_bytes), format_bytes(r.peak_bytes),
                 str(round_ratio(r.step_samples, compiled.step_samples)), _cosine(r), _compared(r), _bound(r)]
                for r in results]
        lines += [f"{workload} (targets: fractions of what torch.compile saves):", "",
                  *_table(("point", "saved activations", "step peak", "step vs compile", "min grad cos",
                           "gradients compared", "published bound"), rows), ""]
        for theirs, winner in wins(results):
            lines.append(f"- {_label(theirs)}: " + (
                f"{winner.label} has no higher peak and is faster with the ranges apart" if winner else
                "no fxmem point is as low, faster with the ranges apart, and within its published bound"))
    return lines


# fidelity -----------------------------------------------------------------------------------------------------

def _fidelity_title(file: ResultFile) -> str:
    tokens = "random token ids" if file.data.get("tokens") == "random" else "real text"
    return f"Gradient fidelity: {file.data.get('workload')}, {tokens}"


def _fidelity(file: ResultFile) -> list[str]:
    rows = []
    for r in file.results:
        first = r["comparisons"][0]
        same, fp32 = first["same_dtype"], first["fp32"]
        cosine, bound = _cosine_and_bound(r, file)
        rows.append([r["method"], r.get("dtype", ""), format_bytes(r["saved_bytes"]), cosine, str(_count(same)),
                     short_name(same["worst_parameter"]), f"{fp32['min_cosine']:.4f}", bound])
    return [*_table(("method", "dtype", "saved", "min grad cos", "gradients compared", "worst parameter",
                     "min cos vs fp32 eager", "published bound"), rows),
            "", ("min grad cos: against eager PEFT in the same dtype; vs fp32 eager: at the same weights, in fp32 "
                "(eager's own row is the dtype's floor). exact and runlora in a half dtype are held to its rounding: "
                "their cosine against fp32 eager no lower than eager's own there, less as much again.")]


# Presets published as computing what torch computes, to rounding (PUBLISHED_MIN_COSINE's 0.9999 is fp32's): in a
# half-precision dtype they are held to that dtype's rounding instead, measured by eager PEFT's own distance there
ROUNDING_ONLY = frozenset({"exact", "runlora"})


def _cosine_and_bound(result: dict[str, Any], file: ResultFile) -> tuple[str, str]:
    """A fidelity result's worst cosine against eager in its own dtype, and the bound it is held to: its preset's
    published one; for a ROUNDING_ONLY preset in a half dtype, its cosine against fp32 eager no lower than eager's
    own in that dtype, less as much again (the dtype's rounding, with room for summing in another order)."""
    cosine = result["comparisons"][0]["same_dtype"]["min_cosine"]
    bound = PUBLISHED_MIN_COSINE.get(result["method"])
    eager = next((r for r in file.results if r["method"] == "eager"), None)
    if result["method"] in ROUNDING_ONLY and result.get("dtype") not in (None, "float32") and eager is not None:
        floor = 2 * eager["comparisons"][0]["fp32"]["min_cosine"] - 1
        met = result["comparisons"][0]["fp32"]["min_cosine"] >= floor
        return f"{cosine:.4f}", f"{result['dtype']} rounding: {floor:.4f} vs fp32" + ("" if met else " (missed)")
    return f"{cosine:.4f}", "—" if bound is None else f"{bound:g}" + ("" if cosine >= bound else " (missed)")


# context ------------------------------------------------------------------------------------------------------

def _context_results(file: ResultFile) -> list[ContextResult]:
    return [ContextResult.from_dict(r) for r in file.results]


def _context_title(file: ResultFile) -> str:
    return f"Tokens that fit: {_workloads(file)} under {format_bytes(file.data['memory_cap'])}"


def _best_baseline(results: Sequence[ContextResult]) -> ContextResult | None:
    """The baseline that fits the most tokens (the fastest per token among equals)."""
    baselines = [r for r in results if not r.method.startswith("fxmem") and r.longest]
    return max(baselines, key=lambda r: (r.longest, -(r.seconds_per_token or 0.0)), default=None)


def _context_versus(r: ContextResult, best: ContextResult | None) -> tuple[str, str]:
    """``r``'s longest length and time per token, as ratios to ``best``'s."""
    if best is None or not r.longest:
        return "—", "—"
    per_token = (f"{r.seconds_per_token / best.seconds_per_token:.2f}x" if r.seconds_per_token
                 and best.seconds_per_token else "—")
    return f"{r.longest / best.longest:.2f}x", per_token


def _context_cosine(r: ContextResult) -> tuple[str, str, str]:
    if r.fidelity is None:
        return "—", "—", "—"
    bound = "—" if r.fidelity_bound is None else f"{r.fidelity_bound:g}" + (
        "" if r.fidelity.min_cosine >= r.fidelity_bound else " (missed)")
    return f"{r.fidelity.min_cosine:.6f}", str(_count(r.fidelity.to_dict())), bound


def _context(file: ResultFile) -> list[str]:
    results = _context_results(file)
    best = _best_baseline(results)
    rows = [[r.method, f"{r.longest:,}" + ("" if r.converged else " (search stopped)"), *_context_versus(r, best),
             f"{r.shortest_failing:,}" if r.shortest_failing else "—", *_context_cosine(r)] for r in results]
    return [*_table(("method", "longest fitting", "vs best baseline", "time per token vs best baseline",
                     "shortest failing", "min grad cos", "gradients compared", "published bound"), rows), "",
            (f"Batch 1; a length fits where weights, optimizer state and the step's peak stay under "
             f"{format_bytes(file.data['memory_cap'])}. Best baseline: "
             f"{best.method if best else 'none fitted'}. Time per token: one step at the method's own longest "
             "length over its tokens. min grad cos: fxmem's first-step gradients against eager PEFT's at the same "
             "length, weights and batch.")]


def _context_summary(files: Sequence[ResultFile]) -> list[str]:
    rows = []
    for file in (f for f in files if f.kind == "context"):
        results = _context_results(file)
        best = _best_baseline(results)
        for r in results:
            if r.method.startswith("fxmem") and best is not None:
                cosine, compared, bound = _context_cosine(r)
                rows.append([r.workload, format_bytes(file.data["memory_cap"]), r.method.removeprefix("fxmem "),
                             f"{r.longest:,}", f"{best.method} {best.longest:,}", *_context_versus(r, best),
                             f"{cosine} ({bound}), {compared} gradients"])
    return _table(("workload", "memory cap", "fxmem preset", "tokens that fit", "best baseline",
                   "tokens vs it", "time per token vs it", "min grad cos (published bound)"), rows) if rows else []


# coverage -----------------------------------------------------------------------------------------------------

COVERAGE_REFERENCE = "llama"  # each family's reduction is also given as a share of this one's
LOSSY_PRESETS = ("hyclora-4bit", "hyclora-2bit")


def _coverage_title(file: ResultFile) -> str:
    return "Model families: saved bytes and gradients"


def _coverage_cell(result: dict[str, Any] | None, reference: float | None = None) -> str:
    """A preset's worst cosine and reduction on a family (with the reduction's share of the reference family's),
    its published bound marked where missed."""
    if result is None:
        return "—"
    _count(result["fidelity"])  # refuses a figure that did not count its gradients
    cosine = result["fidelity"]["min_cosine"]
    bound = PUBLISHED_MIN_COSINE.get(result["preset"])
    if result["preset"] in ROUNDING_ONLY:  # held to rounding; in bf16 no fp32 eager was run to measure it by
        bound = bound if result["dtype"] == "fp32" else None
    missed = " (missed)" if bound is not None and cosine < bound else ""
    share = f" ({result['reduction'] / reference:.0%} of llama's)" if reference else ""
    return f"{cosine:.4f}{missed}, {result['reduction']:.2f}x{share}"


def _coverage_grid(file: ResultFile) -> tuple[list[str], dict[tuple[str, str], dict[str, dict[str, Any]]]]:
    """The presets measured, and each (family, dtype)'s results by preset, in the order they ran."""
    grid: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in file.results:
        grid.setdefault((r["family"], r["dtype"]), {})[r["preset"]] = r
    return list(dict.fromkeys(r["preset"] for r in file.results)), grid


def _coverage(file: ResultFile) -> list[str]:
    presets, grid = _coverage_grid(file)
    rows = []
    for (family, dtype), by_preset in grid.items():
        reference = grid.get((COVERAGE_REFERENCE, dtype), {})
        eager = next(iter(by_preset.values()))["eager_bytes"]
        rows.append([family, dtype, format_bytes(eager), *(_coverage_cell(
            by_preset.get(p), None if family == COVERAGE_REFERENCE else reference.get(p, {}).get("reduction"))
            for p in presets)])
    compared = sorted({_count(r["fidelity"]) for r in file.results})
    return [*_table(("family", "dtype", "eager saved", *presets), rows), "",
            (f"Each cell: the worst LoRA-gradient cosine against eager PEFT in the same dtype (every one of "
             f"{', '.join(map(str, compared))} gradients compared, B past init), then eager's saved bytes over "
             "fxmem's, and that reduction as a share of the Llama family's at the same preset; (missed): below the "
             "preset's published bound (exact in bf16 is held to no fp32 bound).")]


def _coverage_summary(files: Sequence[ResultFile]) -> list[str]:
    """The lossy presets on every family, one table: worst cosine and fewer saved bytes, per dtype. Each cell from
    the newest file that measured it (``files`` newest first); families in the order the newest file ran them."""
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}  # (family, preset, dtype)
    for file in (f for f in files if f.kind == "coverage"):
        for r in file.results:
            if r["preset"] in LOSSY_PRESETS:
                cells.setdefault((r["family"], r["preset"], r["dtype"]), r)
    if not cells:
        return []
    dtypes = list(dict.fromkeys(d for _, _, d in cells))
    columns = [(p, d) for d in dtypes for p in LOSSY_PRESETS if any(c[1:] == (p, d) for c in cells)]
    families = list(dict.fromkeys(family for family, _, _ in cells))
    return _table(("family", *(f"{p}, {d}" for p, d in columns)),
                  [[family, *(_coverage_cell(cells.get((family, p, d))) for p, d in columns)] for family in families])


@dataclass(frozen=True)
class Renderer:
    title: Callable[[ResultFile], str]
    render: Callable[[ResultFile], list[str]]


# what the page shows, in its order
RENDERERS = {"compare": Renderer(_compare_title, _compare), "context": Renderer(_context_title, _context),
             "frontier": Renderer(_frontier_title, _frontier), "fidelity": Renderer(_fidelity_title, _fidelity),
             "coverage": Renderer(_coverage_title, _coverage)}
