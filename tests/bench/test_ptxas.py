"""Every Triton kernel built for an H100 (sm_90) with no GPU: each compiles, and ptxas spills no register.

One subprocess builds them all (fxmem_bench/ptxas.py); ptxas ships with Triton's CUDA backend.
"""

import pytest

from fxmem.kernels import lora_epilogue as epilogue
from fxmem.kernels.quantize import BITS_CHOICES
from fxmem_bench import ptxas

pytestmark = pytest.mark.skipif(epilogue.triton is None, reason="triton is not installed")


def test_every_kernel_builds_for_sm90_in_every_variant_without_spilling():
    builds = ptxas.compile_kernels(90)  # one test: a fixture shared by two would build once per xdist worker
    failed = [f"{b.kernel} {b.variant}: {b.error}" for b in builds if b.error]
    assert not failed, "\n".join(failed)
    spilled = [f"{b.kernel} {b.variant}: {b.spill_bytes} B spilled, {b.registers} registers" for b in builds
               if b.spill_bytes or b.stack_bytes]
    assert not spilled, "\n".join(spilled)
    assert all(0 < b.registers <= 255 for b in builds)
    # each kernel in each dtype pair, bit width and GELU form
    kernels = {name for name in dir(epilogue) if name.startswith("_lora_") and name.endswith("_kernel")}
    assert {b.kernel for b in builds} == kernels
    for kernel in kernels:
        variants = " | ".join(b.variant for b in builds if b.kernel == kernel)
        for dtype in ("fp32", "bf16", "fp16"):
            assert f"act={dtype} lora={dtype}" in variants
            assert f"act={dtype} lora=fp32" in variants
        if "backward" in kernel:
            assert all(f"bits={bits}" in variants for bits in BITS_CHOICES)
        if "gelu" in kernel:
            assert all(f"gelu={form}" in variants for form in epilogue.GELU_APPROXIMATIONS)


def test_the_command_prints_the_figures_and_fails_on_a_build_error(monkeypatch, capsys, tmp_path):
    from fxmem.cli import main
    found = [ptxas.KernelBuild("_lora_gelu_forward_kernel", "act=bf16 lora=bf16 gelu=none", 79, 0, 0, 4096),
             ptxas.KernelBuild("_lora_gelu_backward_kernel", "act=fp32 lora=fp32 bits=4 gelu=none",
                               error="PTXASError: ptxas failed\nmore")]
    monkeypatch.setattr(ptxas, "compile_kernels", lambda arch: found)
    assert main(["bench", "ptxas", "--json", str(tmp_path / "out.json")]) == 1
    out = capsys.readouterr().out
    assert "sm_90" in out and "PTXASError: ptxas failed" in out and "more" not in out
    assert '"registers": 79' in (tmp_path / "out.json").read_text()
