"""fxmem's custom ops (``torch.ops.fxmem.*``): a torch reference (the CPU path and the oracle) and a Triton
kernel for CUDA each, one module per op family. Importing this package registers every op; nothing here imports
the rest of fxmem."""

from fxmem.kernels import (
    calibration,
    grouped_lora,
    lora_epilogue,
    lowrank,
    nf4,
    onednn_matmul,
    probe,
    quantize,
    runlora,
)

__all__ = ["calibration", "grouped_lora", "lora_epilogue", "lowrank", "nf4", "onednn_matmul", "probe", "quantize", "runlora"]
