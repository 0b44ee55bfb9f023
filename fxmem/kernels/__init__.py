"""fxmem's custom ops (``torch.ops.fxmem.*``): a torch reference (the CPU path and the oracle) and a Triton
kernel for CUDA each, one module per op family."""
