"""fxmem: a torch.compile backend that makes fine-tuning fit in less memory.

    model = torch.compile(model, backend="fxmem")                      # the 'exact' preset
    model = torch.compile(model, backend=fxmem.backend(preset="exact"))
    fxmem.compile_(model, preset="hyclora-4bit")                      # in place: HF Trainer, TRL
    report = fxmem.inspect(model, **batch)                            # what is saved, and why
    fxmem.check_fidelity(model, batch, preset="hyclora-4bit")         # how far it bends the gradients, and why
    fxmem.prepare_peft(model)     # PEFT's LoRA on routers and experts: compiled once, experts' LoRA unmerged
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from fxmem.config import PRESETS, Config  # imports no torch
from fxmem.fallback import FallbackError, FallbackWarning  # nor this
from fxmem.version import __version__

if TYPE_CHECKING:
    from fxmem import measure
    from fxmem.backend import Backend, backend, compile_
    from fxmem.fidelity import FidelityReport, check_fidelity
    from fxmem.inspection import inspect
    from fxmem.peft_lora import prepare_peft
    from fxmem.report import Report

# The rest of the API imports torch and the compile stack: it loads on first use (PEP 562), so that `fxmem --help`
# and the config need none of it. Each of these modules imports fxmem.kernels, which registers torch.ops.fxmem.*
# before anything of theirs can use the ops.
_LAZY = {"Backend": "fxmem.backend", "backend": "fxmem.backend", "compile_": "fxmem.backend",
         "FidelityReport": "fxmem.fidelity", "check_fidelity": "fxmem.fidelity", "inspect": "fxmem.inspection",
         "prepare_peft": "fxmem.peft_lora", "Report": "fxmem.report"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:  # a subpackage (fxmem.measure, fxmem.analysis, ...): the import binds it here
        try:
            return importlib.import_module(f"fxmem.{name}")
        except ModuleNotFoundError as error:
            if error.name != f"fxmem.{name}":
                raise
            raise AttributeError(f"module 'fxmem' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"measure"})


class _Package(types.ModuleType):
    """Keeps ``fxmem.backend`` the function: importing the module fxmem.backend binds it on the package, where the
    function of the same name must stay (``importlib.import_module("fxmem.backend")`` reaches the module)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "backend" and isinstance(value, types.ModuleType):
            value = value.backend
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = ["PRESETS", "Backend", "Config", "FallbackError", "FallbackWarning", "FidelityReport", "Report",
           "__version__", "backend", "check_fidelity", "compile_", "inspect", "measure", "prepare_peft"]
