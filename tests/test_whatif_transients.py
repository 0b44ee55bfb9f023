"""whatif's step against a real compiled step, for every long-context option under exact and hyclora-4bit.

`fxmem whatif --max-context` counts a step as the saved activations and, beside them, the transients as inductor runs
the graphs (``ActivationBytes.step``); ``measure_length`` (`fxmem bench context`'s probe) measures the peak of a real
compiled training step on this CPU above the static bytes. The tests' tiny Llama, batch 1, at two lengths of four and
eight chunks. Cases outside the bound are marked with what the generated code (``TORCH_LOGS=output_code``) and the
profiler's live allocations at the measured peak show that the model does not count (docs/long-context.md).
"""

import pytest
import torch

from fxmem.bench.context import measure_length
from fxmem.config import Config
from fxmem.whatif import layer_scaled_activation_bytes
from tests.conftest import TINY_LLAMA

RANK = 8
CHUNK = 64  # tokens: the rows of each chunk of the chunked options
LENGTHS = (256, 512)
OPTIONS = {"none": {}, "mlp_chunk": {"mlp_chunk": CHUNK}, "norm_chunk": {"norm_chunk": CHUNK},
           "linear_chunk": {"linear_chunk": CHUNK}, "block_checkpoint": {"block_checkpoint": True}}
BOUND = 0.10  # |predicted / measured - 1|

# Where a backward recomputes the MLP's products (block_checkpoint; hyclora-4bit's plan, its MLP linears whole),
# inductor fuses the SwiGLU backward's element-wise ops into one kernel after every matmul feeding it, which writes 5
# MLP-wide outputs at once: at the measured peak 10 or 11 MLP-wide buffers are alive, where the graph's order, which
# the model follows, has 8. Where inductor places its kernels is not modelled (analysis/liveness.py).
FUSED_SWIGLU_BACKWARD = ("inductor's fused SwiGLU backward (5 MLP-wide outputs, after every matmul feeding it): "
                         "10-11 MLP-wide buffers live at the measured peak, 8 in the graph's order")
# CPU flash attention's backward holds, per thread, a block of attention probabilities and their gradient (64 x 512
# floats each at 512 tokens: 256 KiB) that no graph shows; whatif, which predicts for any device, does not count it.
FLASH_WORKSPACE = "CPU flash attention backward's own 256 KiB (2 x 64 x 512 floats, one thread), in no graph"
# The quantizer reads the clamped copy of each MLP tensor five times (its minimum, maximum and sum, the code's sub and
# mul). Inductor counts the loads inside a value (one here) and computes it in every reader; the model, which bounds
# the readers at four instead (analysis/liveness.py), stores three MLP-wide copies in forward and puts the step's peak
# there. A bound of five brings these cases to 1.09x but takes llama-small's 2,048-token step (mlp_chunk and
# linear_chunk at 512) from 1.00x of the measured to 0.93x, so the bound stays.
STORED_CLAMPED_COPIES = ("the model stores the quantizer's clamped MLP-wide copies in forward (5 readers, over its "
                         "bound of 4), which inductor computes inside each reader (1 load)")
OUTSIDE_THE_BOUND = {  # (preset, option, length): why, and the ratio measured
    ("exact", "block_checkpoint", 256): f"{FUSED_SWIGLU_BACKWARD}: 0.776x",
    ("exact", "block_checkpoint", 512): f"{FUSED_SWIGLU_BACKWARD}: 0.773x",
    ("hyclora-4bit", "none", 256): f"{FUSED_SWIGLU_BACKWARD}: 0.752x",
    ("hyclora-4bit", "none", 512): f"{FUSED_SWIGLU_BACKWARD}: 0.733x",
    ("hyclora-4bit", "norm_chunk", 256): f"{FUSED_SWIGLU_BACKWARD}: 0.835x",
    ("hyclora-4bit", "block_checkpoint", 256): f"{FUSED_SWIGLU_BACKWARD}: 0.772x",
    ("hyclora-4bit", "block_checkpoint", 512): f"{FUSED_SWIGLU_BACKWARD}: 0.769x",
    ("hyclora-4bit", "mlp_chunk", 512): f"{FLASH_WORKSPACE}, at the measured peak: 0.887x",
    ("hyclora-4bit", "linear_chunk", 256): f"{STORED_CLAMPED_COPIES}: 1.204x",
    ("hyclora-4bit", "linear_chunk", 512): f"{STORED_CLAMPED_COPIES}: 1.202x",
}


@pytest.fixture
def one_thread():
    """The measured step on one thread: CPU kernels' per-thread workspace (FLASH_WORKSPACE) grows with the threads
    (hyclora-4bit with linear_chunk at 256 tokens measured 9% more on 4 than on 1 or 2), so one keeps the measured
    step, and which cases fall outside the bound, the same on every machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cases():
    for preset in ("exact", "hyclora-4bit"):
        for option in OPTIONS:
            for seq in LENGTHS:
                why = OUTSIDE_THE_BOUND.get((preset, option, seq))
                yield pytest.param(preset, option, seq, id=f"{preset}-{option}-{seq}",
                                   marks=[pytest.mark.xfail(strict=True, reason=why)] if why else [])


@pytest.mark.parametrize("preset, option, seq", list(cases()))
def test_whatifs_step_is_within_10_percent_of_a_measured_compiled_step(one_thread, preset, option, seq):
    config = Config.from_preset(preset, return_logits=False, **OPTIONS[option])
    predicted, _ = layer_scaled_activation_bytes(TINY_LLAMA.hf_config(), rank=RANK, dtype=torch.float32, batch=1,
                                                 seq=seq, preset=config)
    measured = measure_length(TINY_LLAMA, "fxmem", seq, config=config, device=torch.device("cpu"),
                              lora_rank=RANK).probe.peak_bytes
    assert abs(predicted.step / measured - 1) <= BOUND, (predicted.step, measured, predicted.step / measured)
