"""`fxmem bench plans`: every saved tensor's plan on tiny configurations against the committed dump
(benchmarks/plans.json), or the dump rewritten (fxmem_bench/plans.py)."""

from __future__ import annotations

import argparse
import json
import pathlib

from fxmem.cli.common import console
from fxmem_bench.plans import CONFIGURATION_NAMES, DEFAULT_FILE, HEADER, WRITE_COMMAND

NAME = "plans"


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="golden plans: every saved tensor's plan on tiny configurations, "
                                               f"checked against {DEFAULT_FILE} or written to it")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", dest="write", action="store_false",
                      help="compare the plans with the dump; exit 1 on a difference (the default)")
    mode.add_argument("--write", action="store_true", help="rewrite the dump with the plans")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help=f"these configurations alone (default: every one): {', '.join(CONFIGURATION_NAMES)}")
    parser.add_argument("--file", type=pathlib.Path, metavar="PATH",
                        help=f"the dump (default: {DEFAULT_FILE} in the repository the harness is in, or the current "
                             "directory)")
    parser.set_defaults(run=run, write=False)  # --check's store_false would default to True


def _default_file(write: bool) -> pathlib.Path:
    """DEFAULT_FILE in the checkout the harness is in, else in the current directory: the first that exists (to
    write: the first whose directory exists); FileNotFoundError names both where there is none."""
    candidates = [pathlib.Path(__file__).resolve().parents[2] / DEFAULT_FILE, pathlib.Path.cwd() / DEFAULT_FILE]
    for candidate in candidates:
        if candidate.parent.is_dir() if write else candidate.is_file():
            return candidate
    looked = " or ".join(str(c.parent if write else c) for c in candidates)
    raise FileNotFoundError(f"{'no directory' if write else 'no dump'} at {looked}: run from the repository root, or "
                            "name the dump with --file" + ("" if write else f"; `{WRITE_COMMAND}` writes it"))


def run(args: argparse.Namespace) -> int:
    from fxmem_bench.plans import differences, dump, dump_text, get_configurations, header

    try:
        configurations = get_configurations(args.only)
        path = args.file or _default_file(args.write)
        if not (args.write or path.is_file()):
            raise FileNotFoundError(f"no dump at {path}; `{WRITE_COMMAND} --file {path}` writes it")
    except (ValueError, FileNotFoundError) as error:
        console.print(f"[red]{error}[/red]", highlight=False)
        return 2
    stored = json.loads(path.read_text()) if path.is_file() else {}
    with console.status("") as status:
        plans = dump(configurations, lambda c: status.update(f"{c.name}: {c.model.family}, {c.preset}"))
    if args.write:
        # --only rewrites those configurations; the dump's others stay
        kept = {name: plan for name, plan in stored.items() if name != HEADER} if args.only else {}
        path.write_text(dump_text(header(), {**kept, **plans}))
        console.print(f"wrote {len(plans)} configuration(s) to {path}")
        return 0
    found = differences(stored, plans, every_configuration=args.only is None)
    for name, lines in found.items():
        console.print(f"[bold]{name}[/bold]", highlight=False)
        for line in lines:
            console.print(f"  {line}", markup=False, highlight=False)
    if not found:
        console.print(f"{len(plans)} configuration(s) plan as {path} says")
        return 0
    written, now = stored.get(HEADER, {}).get("versions"), header()["versions"]
    if written != now:
        console.print(f"the dump was written with {written}, this is {now}: a new version may rename graph nodes",
                      highlight=False)
    console.print(f"{len(found)} configuration(s) differ from {path}; if the change is meant, rewrite it with "
                  f"`{WRITE_COMMAND}` in the same commit", highlight=False)
    return 1
