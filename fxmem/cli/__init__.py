"""The `fxmem` command: `inspect` and `whatif` for users; every experiment under `fxmem bench <experiment>`, from a
clone of the repository (the experiment harness is not installed with fxmem)."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

from fxmem.cli import inspect, whatif
from fxmem.cli.common import console, with_default_device
from fxmem.cli.harness import MISSING, HarnessMissing, harness_module


def command_parser() -> argparse.ArgumentParser:
    """The parser of every command; building it imports no torch (the commands import it in their ``run``). `bench`
    is the harness's where there is one, else a name in the list (main exits on it, saying where the harness lives)."""
    parser = argparse.ArgumentParser(prog="fxmem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (inspect, whatif):
        command.add_parser(commands)
    try:
        harness_module("cli").add_parser(commands)
    except HarnessMissing:
        commands.add_parser("bench", help="the experiments behind docs/benchmarks.md, from a clone of the repository")
    return parser


def bench_command() -> ModuleType:
    """The harness's command line (fxmem_bench.cli), or an exit that says where the harness lives."""
    try:
        return harness_module("cli")
    except HarnessMissing:
        raise SystemExit(f"fxmem bench: {MISSING}") from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        argv = bench_command().with_default_experiment(argv)
    args = with_default_device(command_parser().parse_args(argv))
    args.command_line = "fxmem " + " ".join(shlex.quote(a) for a in argv)
    if not console.is_terminal:  # piped or captured: wide rows instead of columns wrapped at 80
        console.width = max(console.width, 200)
    # transformers warns about its own deprecations on every traced forward; they are not the user's concern here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    # peft imports bitsandbytes, which warns that an optional CPU gemv kernel package is absent; fxmem never uses it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # the benchmarks compile with caches off on purpose; torch says so once per compile.
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    return args.run(args)

