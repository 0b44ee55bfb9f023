"""fxmem: a torch.compile backend that makes fine-tuning fit in less memory.

    model = torch.compile(model, backend="fxmem")                      # the 'exact' preset
    model = torch.compile(model, backend=fxmem.backend(preset="exact"))
    fxmem.compile_(model, preset="hyclora-4bit")                      # in place: HF Trainer, TRL
    report = fxmem.inspect(model, **batch)                            # what is saved, and why
    fxmem.check_fidelity(model, batch, preset="hyclora-4bit")         # how far it bends the gradients, and why
"""

__version__ = "0.1.0"

from fxmem import (
    kernels,  # noqa: F401  registers torch.ops.fxmem.* before anything uses them
    measure,
)
from fxmem.backend import Backend, backend, compile_
from fxmem.config import PRESETS, Config
from fxmem.fallback import FallbackError, FallbackWarning
from fxmem.fidelity import FidelityReport, check_fidelity
from fxmem.inspection import inspect
from fxmem.report import Report

__all__ = ["PRESETS", "Backend", "Config", "FallbackError", "FallbackWarning", "FidelityReport", "Report", "__version__", "backend", "check_fidelity",
           "compile_", "inspect", "measure"]
