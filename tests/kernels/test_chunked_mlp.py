import pytest
import torch

from fxmem.kernels.chunked_lora_linear import LoraLinear
from fxmem.kernels.chunked_mlp import chunked_swiglu_mlp, swiglu_mlp_reference, workspace_bytes
from fxmem.measure import peak_memory

HIDDEN, WIDTH, RANK = 32, 88, 4


def _mlp(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def linear(out, inp):  # PEFT's: the base in the model's dtype, fp32 factors, B past its zero init
        return LoraLinear((torch.randn(out, inp, generator=generator) / inp**0.5).to(dtype),
                          (torch.randn(RANK, inp, generator=generator) / inp**0.5).requires_grad_(),
                          (torch.randn(out, RANK, generator=generator) / RANK**0.5).requires_grad_(), 2.0)

    x = torch.randn(2, 37, HIDDEN, generator=generator).to(dtype).requires_grad_()
    return x, linear(WIDTH, HIDDEN), linear(WIDTH, HIDDEN), linear(HIDDEN, WIDTH)


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-6), (torch.bfloat16, 0.999)])
@pytest.mark.parametrize("chunk_rows", [1, 16, 74, 1000])
def test_the_chunked_mlp_matches_torch_in_output_and_every_gradient(dtype, bound, chunk_rows):
    x, gate, up, down = _mlp(dtype)
    trained = [x, gate.a, gate.b, up.a, up.b, down.a, down.b]
    grad_out = torch.randn(2, 37, HIDDEN, generator=torch.Generator().manual_seed(5)).to(dtype)
    reference = swiglu_mlp_reference(x, gate, up, down)
    expected = torch.autograd.grad(reference, trained, grad_out)
    output = chunked_swiglu_mlp(x, gate, up, down, chunk_rows)
    assert output.dtype == dtype and output.shape == reference.shape
    got = torch.autograd.grad(output, trained, grad_out)
    for name, want, have in zip(("x", "gate A", "gate B", "up A", "up B", "down A", "down B"), expected, got,
                                strict=True):
        assert have.dtype == want.dtype, name
        if dtype == torch.float32:  # the same products on fewer rows: rounding only
            assert float((have - want).abs().max()) <= bound * 10 * float(want.abs().max()), name
        else:  # bf16: torch rounds each op's output; the recomputed ones round alike but not identically
            cosine = torch.nn.functional.cosine_similarity(have.float().flatten(), want.float().flatten(), 0)
            assert float(cosine) >= bound, name
    if dtype == torch.float32:
        assert float((output - reference).abs().max()) <= 1e-6 * float(reference.abs().max())
    else:
        assert torch.equal(output, reference)  # forward: the same ops on each chunk's rows


def test_bad_arguments_are_refused():
    x, gate, up, down = _mlp(torch.float32)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1; got 0"):
        chunked_swiglu_mlp(x, gate, up, down, 0)
    with pytest.raises(ValueError, match="the up projection's base weight trains"):
        chunked_swiglu_mlp(x, gate, up._replace(weight=up.weight.clone().requires_grad_()), down, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, chunk_rows", [(1024, 256), (1024, 2048)])
def test_the_workspace_is_what_the_op_holds_beyond_its_inputs_and_outputs(dtype, rows, chunk_rows):
    x, gate, up, down = _mlp(dtype)
    x = torch.randn(rows, HIDDEN).to(dtype)
    grad_out = torch.randn(rows, HIDDEN).to(dtype)
    flat = (*gate, *up, *down)
    held = rows * HIDDEN * x.element_size()  # the output, or d x
    accumulators = sum(t.numel() * 4 for t in (gate.a, gate.b, up.a, up.b, down.a, down.b))
    forward = peak_memory(lambda: torch.ops.fxmem.chunked_swiglu_mlp(x, *flat, chunk_rows), "cpu") - held
    backward = peak_memory(lambda: torch.ops.fxmem.chunked_swiglu_mlp_backward(grad_out, x, *flat, chunk_rows),
                           "cpu") - held - accumulators
    shape = (rows, chunk_rows, WIDTH, x.element_size())
    assert forward == workspace_bytes(*shape, backward=False)
    beyond = backward - workspace_bytes(*shape, backward=True)
    if dtype == torch.float32:  # and the LoRA gradients' products, at most their accumulators (measured: 12 bytes)
        assert 0 <= beyond <= accumulators
    else:  # in bf16 the last MLP-wide tensor is gone before the hidden-wide rows are made (measured: 32 bytes a row
        # fewer), and the CPU's matmuls take a scratch buffer whatever the rows (measured: 41.6 KiB at most)
        assert abs(beyond) <= min(rows, chunk_rows) * HIDDEN * 4 + accumulators + 48 * 1024
