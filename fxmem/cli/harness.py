"""Where the `fxmem` command finds the experiment harness, fxmem_bench: in the repository, beside the fxmem package,
and not in the installed package (as torchtune keeps its recipes apart from its library). `fxmem bench` runs it;
`fxmem inspect` and `fxmem whatif` also take its workloads by name where it is found.

No module of fxmem imports the harness by an import statement (tests/test_architecture.py): this one loads it by
name, when a command asks for it.
"""

from __future__ import annotations

import importlib
import pathlib
import sys
from types import ModuleType
from typing import Any

import fxmem

# The directory above the fxmem package: a clone's root where fxmem is installed editable (its console script does
# not put the repository on sys.path), site-packages where it is installed from a wheel.
CHECKOUT = pathlib.Path(fxmem.__file__).resolve().parents[1]

MISSING = ("the benchmark harness (fxmem_bench) lives in fxmem's repository, not in the installed package; run it "
           "from a clone of the repository: `make demo`, or `python -m fxmem bench ...` in the clone's root")


class HarnessMissing(ImportError):
    """Neither sys.path nor CHECKOUT holds fxmem_bench."""


def harness_module(name: str) -> ModuleType:
    """The harness's module ``name`` (fxmem_bench.<name>): from sys.path, else from CHECKOUT, which it puts on
    sys.path; HarnessMissing where neither holds the harness."""
    module = f"fxmem_bench.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] != "fxmem_bench":
            raise  # the harness is there, and something it imports is not
    if not (CHECKOUT / "fxmem_bench").is_dir():
        raise HarnessMissing(MISSING)
    sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(module)


def workload_names() -> list[str]:
    """The harness's workloads (read without torch); none where there is no harness."""
    try:
        return list(harness_module("choices").WORKLOAD_FAMILIES)
    except HarnessMissing:
        return []


def get_workload(name: str) -> Any:
    """The harness's workload ``name`` (tests replace fxmem_bench.workloads.get_workload to run a tiny model)."""
    return harness_module("workloads").get_workload(name)


def listed_workloads() -> str:
    """The harness's workloads, comma-separated, for help and errors; where there is no harness, where they are."""
    return ", ".join(workload_names()) or "the harness's, from a clone of the repository"
