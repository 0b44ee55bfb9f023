"""What every `fxmem` subcommand shares: the console, option groups, argument types, and the one table writer.

It imports no torch, nor anything that does: the parsers are built from it, and `fxmem --help` answers without the
compile stack. The commands import what they run in their ``run``.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fxmem.choices import check_lowrank
from fxmem.config import PRESETS

if TYPE_CHECKING:
    import torch

console = Console()


def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {value}")
        return value
    return parse


BYTE_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def byte_size(text: str) -> int:
    """A memory size: a number of bytes, or a number followed by one of BYTE_UNITS (``2GiB``, ``1.5 GiB``)."""
    number = text.strip()
    unit = next((u for u in sorted(BYTE_UNITS, key=len, reverse=True) if number.endswith(u)), "B")
    try:
        value = float(number.removesuffix(unit).strip()) * BYTE_UNITS[unit]
        if not math.isfinite(value):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes, or a number with a unit ({', '.join(BYTE_UNITS)}); "
                                         f"got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte; got {text!r}")
    return int(value)


def lowrank_rank(text: str) -> float | int:
    """A ``Config.lowrank`` value: a ratio in (0, 1) of the last dimension or an integer rank."""
    try:
        value = int(text) if text.isdigit() else float(text)
        check_lowrank(value, allow_none=False)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


def config_override(text: str) -> tuple[str, Any]:
    """NAME=VALUE, VALUE a Python literal (None, 8, 0.125, True, "static"), for a Config field; Config checks both."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (e.g. bits=None); got {text!r}")
    try:
        return name, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return name, value  # a bare word: a string ("static")


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device(parser: argparse.ArgumentParser) -> None:
    """--device, by default CUDA where there is one: left None here and decided by with_default_device, since
    asking torch would import it to build the parser."""
    parser.add_argument("--device")


def with_default_device(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with --device decided where add_device left it unset."""
    if "device" in vars(args) and args.device is None:
        args.device = default_device()
    return args


def add_preset(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="exact", choices=list(PRESETS))


def add_outputs(parser: argparse.ArgumentParser, *, json_results: bool = True) -> None:
    """--markdown (the table as markdown) and, where the command has per-run results, --json (raw results)."""
    if json_results:
        parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="write the raw results as JSON")
    parser.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")


def progress_bars(label_width: int = 22) -> Progress:
    """One bar per run, with its latest loss."""
    return Progress(TextColumn(f"{{task.description:<{label_width}}}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console)


def machine_description(device: torch.device | str) -> str:
    import torch
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def source_commit() -> str:
    """The commit fxmem's source is at ('+' when it or the harness beside it, fxmem_bench, has uncommitted changes),
    or 'unknown' outside a checkout."""
    here = pathlib.Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "fxmem", "fxmem_bench"],
                               cwd=here.parents[1], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+" if dirty else "")


def run_metadata(args: argparse.Namespace, device: torch.device | str = "cpu") -> dict[str, str]:
    """When, where and from what a table was made: every published number carries it."""
    return {"command": args.command_line, "date": datetime.date.today().isoformat(),
            "machine": machine_description(device), "commit": source_commit()}


Section = tuple[str, Sequence[str], list[list[str]], str]  # title, columns, rows, legend


def print_table(title: str, columns: Sequence[str], rows: list[list[str]], legend: str,
                args: argparse.Namespace, device: torch.device | str = "cpu") -> None:
    """Print a table (first column left-aligned), its legend and where it comes from; with --markdown, also write
    them as markdown."""
    show_table(title, columns, rows, legend)
    provenance = provenance_line(run_metadata(args, device))
    console.print(provenance)
    write_markdown([(title, columns, rows, legend)], args, device)


def show_table(title: str, columns: Sequence[str], rows: list[list[str]], legend: str) -> None:
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(legend)


def provenance_line(metadata: dict[str, str]) -> str:
    return f"{metadata['date']}, {metadata['machine']}, fxmem at {metadata['commit']}"


def write_markdown(sections: Sequence[Section], args: argparse.Namespace, device: torch.device | str = "cpu") -> None:
    """With --markdown, write the command, where it ran and each table with its legend."""
    path = getattr(args, "markdown", None)
    if not path:
        return
    metadata = run_metadata(args, device)
    lines = [f"Command: `{metadata['command']}`", "", f"{provenance_line(metadata)}.", ""]
    for title, columns, rows, legend in sections:
        lines += [f"{title}", "", *markdown_table(columns, rows), legend, ""]
    path.write_text("\n".join(lines))
    console.print(f"wrote {path}")


def markdown_table(columns: Sequence[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table, ending with a blank line."""
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(row) + " |" for row in rows] + [""])


def write_json(results: Sequence[Any], args: argparse.Namespace, device: torch.device | str = "cpu",
               **extra: Any) -> None:
    """With --json, write where the results come from and every result's ``to_dict()``."""
    path = getattr(args, "json", None)
    if path:
        path.write_text(json.dumps({**run_metadata(args, device), **extra,
                                    "results": [r.to_dict() for r in results]}, indent=2))
        console.print(f"wrote {path}")
