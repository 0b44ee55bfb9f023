"""Every Triton kernel fxmem launches, compiled for a GPU with no GPU: ptxas's registers, spills or its error.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` lowers a kernel to PTX and assembles it
with the ptxas that ships with Triton, so a compile error, a register spill or a stack frame shows here as it
would on the GPU. Each kernel is built in every variant a launch can ask for: each bit width of the codes, each
activation dtype, LoRA factors in the activation's dtype or in fp32 (PEFT's ``autocast_adapter_dtype`` on a
half-precision model), each GELU form. The rank is a run-time argument (the LoRA product loops over it), so one
build covers every rank. Pointers carry the 16-byte alignment torch's allocations give them, as a launch
specializes them.

The builds run in a subprocess: under ``TRITON_INTERPRET=1`` (the tests' CPU mode) ``triton.jit`` makes
functions the compiler cannot take, and the subprocess starts without it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from fxmem.kernels.quantize import BITS_CHOICES

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class KernelBuild:
    """One kernel in one variant, as ptxas reports it for the target; ``error`` the compile's, if it failed."""

    kernel: str
    variant: str
    registers: int = 0
    spill_bytes: int = 0  # spill stores + spill loads
    stack_bytes: int = 0
    shared_bytes: int = 0
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Variant:
    kernel: str
    activation: torch.dtype
    lora: torch.dtype
    bits: int | None  # backward kernels read packed codes
    approximate: str | None  # GELU kernels

    @property
    def label(self) -> str:
        parts = [f"act={_TRITON_TYPES[self.activation]}", f"lora={_TRITON_TYPES[self.lora]}"]
        if self.bits is not None:
            parts.append(f"bits={self.bits}")
        if self.approximate is not None:
            parts.append(f"gelu={self.approximate}")
        return " ".join(parts)


def variants() -> list[_Variant]:
    """Each kernel of fxmem/kernels/lora_epilogue.py in each pair of dtypes a launch can ask for, at 4 bits, and
    at every other bit width in fp32 (the most registers); each GELU kernel in both forms (at the other widths,
    the tanh form, which takes more registers)."""
    from fxmem.kernels.lora_epilogue import GELU_APPROXIMATIONS
    dtypes = [(a, lora) for a in ACTIVATION_DTYPES for lora in dict.fromkeys((a, torch.float32))]
    found = []
    for kernel, quantized, gelu in (("_lora_swiglu_backward_kernel", True, False),
                                    ("_lora_swiglu_forward_kernel", False, False),
                                    ("_lora_gelu_backward_kernel", True, True),
                                    ("_lora_gelu_forward_kernel", False, True)):
        widths = [(dtype, 4) for dtype in dtypes] + [((torch.float32, torch.float32), bits)
                                                       for bits in BITS_CHOICES if bits != 4]
        for ((activation, lora), bits), approximate in itertools.product(
                widths if quantized else [(dtype, None) for dtype in dtypes],
                GELU_APPROXIMATIONS if gelu else (None,)):
            if bits in (None, 4) or approximate in (None, "tanh"):  # other widths: the costlier GELU form
                found.append(_Variant(kernel, activation, lora, bits, approximate))
    return found


def _source(variant: _Variant):
    """The kernel's ASTSource for ``variant``: argument types by role (read from the argument's name)."""
    from triton.compiler import ASTSource

    import fxmem.kernels.lora_epilogue as epilogue
    kernel = getattr(epilogue, variant.kernel)
    precision = epilogue._dot_precision(variant.lora, variant.lora)
    constants = {"BITS": variant.bits, "APPROXIMATE_TANH": variant.approximate == "tanh", **epilogue.TILE,
                 "DOT_PRECISION": precision, "GATE_DOT_PRECISION": precision, "UP_DOT_PRECISION": precision}
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name.isupper():
            signature[name] = "constexpr"
            constexprs[(index,)] = constants[name]
        elif name.endswith("_ptr"):
            if "packed" in name:
                kind = "u8"
            elif "scale" in name or "zero" in name:
                kind = "fp32"
            elif name.endswith(("xa_ptr", "b_ptr")):
                kind = _TRITON_TYPES[variant.lora]
            else:
                kind = _TRITON_TYPES[variant.activation]
            signature[name] = "*" + kind
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32" if name.endswith("scaling") else "i32"
    return ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")


def _build(variant: _Variant, arch: int) -> KernelBuild:
    import triton
    from triton.backends.compiler import GPUTarget

    from fxmem.kernels.lora_epilogue import TILE
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # Triton prints ptxas's -v log when dump_ptxas_log is set
            compiled = triton.compile(_source(variant), target=GPUTarget("cuda", arch, 32),
                                      options={"num_warps": TILE["num_warps"]})
    except Exception as error:  # noqa: BLE001  the build's failure is the finding
        return KernelBuild(variant.kernel, variant.label, error=f"{type(error).__name__}: {error}"[:2000])
    text = log.getvalue()
    registers, spills, stack = (pattern.search(text) for pattern in (_REGISTERS, _SPILLS, _STACK))
    if registers is None:
        return KernelBuild(variant.kernel, variant.label, error=f"no ptxas figures in its log: {text[:500]!r}")
    return KernelBuild(variant.kernel, variant.label, registers=int(registers.group(1)),
                       spill_bytes=int(spills.group(1)) + int(spills.group(2)) if spills else 0,
                       stack_bytes=int(stack.group(1)) if stack else 0, shared_bytes=compiled.metadata.shared)


def compile_kernels(arch: int = 90) -> list[KernelBuild]:
    """Build every variant of every kernel for sm_``arch`` in a subprocess (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    code = f"from fxmem_bench.ptxas import _dump; _dump({int(arch)})"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"building the kernels for sm_{arch} failed:\n{done.stderr[-4000:]}")
    return [KernelBuild(**row) for row in json.loads(done.stdout.splitlines()[-1])]


def _dump(arch: int) -> None:
    """The subprocess's side: every build, as JSON on the last line of stdout."""
    import triton
    triton.knobs.nvidia.dump_ptxas_log = True
    triton.knobs.compilation.always_compile = True  # a cached build skips ptxas, and with it the figures
    print(json.dumps([_build(v, arch).to_dict() for v in variants()]))
