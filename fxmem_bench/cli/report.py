"""`fxmem bench report`: docs/benchmarks.md from the result files of chosen commits, the history apart, the README's
summary; and docs/config.md, the configuration's reference, from the code."""

from __future__ import annotations

import argparse
import pathlib

from fxmem.cli.common import console

NAME = "report"


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="write docs/benchmarks.md from benchmarks/results/*.json at chosen "
                                               "commits, the history of the others, and the README's summary")
    parser.add_argument("--commit", required=True, nargs="+",
                        help="the fxmem commits whose results make the page (as the result files record them), "
                             "oldest first: each section says its own, and the summary takes a workload from the "
                             "latest commit that measured it")
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--page", type=pathlib.Path, default=pathlib.Path("docs/benchmarks.md"))
    parser.add_argument("--history", type=pathlib.Path, default=pathlib.Path("docs/history/results.md"))
    parser.add_argument("--readme", type=pathlib.Path, default=pathlib.Path("README.md"))
    parser.add_argument("--config-reference", type=pathlib.Path, default=pathlib.Path("docs/config.md"))
    parser.add_argument("--figure", type=pathlib.Path, default=pathlib.Path("docs/step-peak-time.png"),
                        help="the README's figure: step peak against step time of every method, per workload")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the page, the history, the README's block, its figure "
                             "(by the figures it plots) or the configuration's reference differ from what the "
                             "results and the code make")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem_bench.config_reference import config_reference
    from fxmem_bench.figure import digest, draw, recorded_digest
    from fxmem_bench.report import PAGE_LIMIT, build, load_results, relative_link, with_summary

    if not args.results.is_dir():
        console.print(f"[red]--results {args.results}: no such folder[/red]")
        return 2
    try:
        report = build(load_results(args.results), args.commit, links_from=args.page.parent,
                       history_path=args.history, command=f"fxmem bench report --commit {' '.join(args.commit)}",
                       figure_link=relative_link(args.figure, args.readme.parent))
        readme = with_summary(args.readme.read_text(), report.readme)
    except (ValueError, OSError) as error:
        console.print(f"[red]{error}[/red]")
        return 2
    lines = report.page.count("\n")
    if lines > PAGE_LIMIT:
        console.print(f"[red]the page would be {lines} lines, over {PAGE_LIMIT}: keep fewer result files at "
                      f"commits {', '.join(args.commit)}[/red]")
        return 2
    outputs = {args.page: report.page, args.history: report.history, args.readme: readme,
               args.config_reference: config_reference()}
    figure_stale = bool(report.panels) and recorded_digest(args.figure) != digest(report.panels)
    if args.check:
        stale = [str(path) for path, text in outputs.items() if not path.exists() or path.read_text() != text]
        stale += [str(args.figure)] if figure_stale else []
        for path in stale:
            console.print(f"{path} differs from what the results at {', '.join(args.commit)} and the code make")
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
        console.print(f"wrote {path}")
    if figure_stale:  # drawn only when its figures change: the PNG's pixels vary with matplotlib's version
        draw(report.panels, args.figure)
        console.print(f"wrote {args.figure}")
    return 0
