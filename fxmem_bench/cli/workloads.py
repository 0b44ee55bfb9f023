"""The workloads by name, as the experiments' parsers list them (without torch) and their runs build them."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fxmem_bench.choices import WORKLOAD_FAMILIES

if TYPE_CHECKING:
    from fxmem_bench.workloads import Workload


def get_workload(name: str) -> Workload:
    """A benchmark workload by name (tests replace fxmem_bench.workloads.get_workload to run every command on a tiny
    model)."""
    from fxmem_bench import workloads
    return workloads.get_workload(name)


def workload_names(family: str | None = None) -> list[str]:
    return [name for name, of_family in WORKLOAD_FAMILIES.items() if family is None or of_family == family]


def add_workload(parser: argparse.ArgumentParser, default: str, family: str | None = None) -> None:
    parser.add_argument("--workload", default=default, choices=workload_names(family))
