"""What starting fxmem imports: `import fxmem` nothing of the compile stack until the API is used, and the `fxmem`
command's parsers (`fxmem --help`, every command's and experiment's --help) no torch."""

import subprocess
import sys

import pytest
import torch

from fxmem.cli import command_parser
from fxmem.cli.common import with_default_device

COMPILE_STACK = ("torch", "triton", "transformers", "peft", "matplotlib")


def imported(*args: str, among: tuple[str, ...]) -> list[str]:
    """The modules in or under ``among`` that ``python -X importtime *args`` imports, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    names = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    return sorted(name for name in names if any(name == top or name.startswith(top + ".") for top in among))


def test_import_fxmem_imports_nothing_heavy():
    code = "import fxmem; fxmem.Config.from_preset('hyclora-4bit'); assert not hasattr(fxmem, 'nope')"
    assert imported("-c", code, among=(*COMPILE_STACK, "rich", "fxmem_bench", "fxmem.cli")) == []


def test_the_api_loads_on_first_use_and_registers_the_ops():
    code = """
import importlib, types
import fxmem
import fxmem.inspection  # binds the module fxmem.backend on the package, where the function must stay
from fxmem import (PRESETS, Backend, Config, FidelityReport, Report, __version__, backend, check_fidelity, compile_,
                   inspect, measure)
import torch
assert fxmem.backend is backend and isinstance(backend, types.FunctionType) and backend.__module__ == "fxmem.backend"
assert importlib.import_module("fxmem.backend").backend is backend
assert isinstance(measure, types.ModuleType) and inspect.__module__ == "fxmem.inspection"
assert isinstance(Backend(), Backend) and Report.__module__ == "fxmem.report" and callable(compile_)
assert FidelityReport.__module__ == check_fidelity.__module__ == "fxmem.fidelity"
assert {"exact", "hyclora-4bit"} <= set(PRESETS) and Config is fxmem.Config and __version__ == fxmem.__version__
torch.ops.fxmem.lowrank_decompose, torch.ops.fxmem.calibrated_params  # registered before the backend runs
"""
    assert "torch" in imported("-c", code, among=("torch",))


@pytest.mark.parametrize("command", [[], ["inspect"], ["whatif"], ["bench"], ["bench", "compare"]],
                         ids=lambda command: " ".join(["fxmem", *command]))
def test_help_imports_no_torch(command):
    assert imported("-m", "fxmem", *command, "--help", among=COMPILE_STACK) == []


def test_every_parser_builds_and_formats_its_help_without_torch():
    code = """
import argparse
from fxmem.cli import command_parser

def helps(parser):
    yield parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from helps(sub)

texts = list(helps(command_parser()))
assert len(texts) == 28, len(texts)  # fxmem, inspect, whatif, bench, its 21 experiments, loqt's 3 kinds
"""
    assert imported("-c", code, among=COMPILE_STACK) == []


def test_device_defaults_to_cuda_where_there_is_one_once_parsed():
    parser = command_parser()
    assert with_default_device(parser.parse_args(["bench", "ablate"])).device == \
        ("cuda" if torch.cuda.is_available() else "cpu")
    assert with_default_device(parser.parse_args(["bench", "ablate", "--device", "meta"])).device == "meta"
    assert with_default_device(parser.parse_args(["inspect", "llama-tiny"])).device == "cpu"  # its own default


def test_a_subpackage_loads_on_first_use_and_a_missing_name_is_an_attribute_error():
    code = ("import fxmem; assert fxmem.analysis.analyze and 'inspect' in dir(fxmem)\n"
            "try:\n    fxmem.nope\nexcept AttributeError as error:\n    print(error)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "module 'fxmem' has no attribute 'nope'"
