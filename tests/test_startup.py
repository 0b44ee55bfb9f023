"""What starting fxmem loads: `import fxmem` nothing of the compile stack until the API is used."""

import json
import subprocess
import sys

# Heavy packages (and fxmem's harness) that `import fxmem` must not load: the API loads them on first use.
HEAVY = ("torch", "transformers", "peft", "matplotlib", "rich", "fxmem.bench", "fxmem.cli")


def loaded_after(code: str) -> list[str]:
    """The modules of HEAVY that a fresh interpreter has loaded after running ``code``."""
    script = (f"{code}\nimport json, sys\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m in {HEAVY!r})))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_import_fxmem_loads_nothing_heavy():
    assert loaded_after("import fxmem; fxmem.Config.from_preset('hyclora-4bit'); assert not hasattr(fxmem, 'nope')") \
        == []


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
    assert "torch" in loaded_after(code)
