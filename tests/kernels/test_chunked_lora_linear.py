import pytest
import torch

from fxmem.kernels.chunked_lora_linear import LoraLinear, chunked_lora_linears, lora_linear, workspace_bytes
from fxmem.measure import peak_memory

FEATURES, RANK = 32, 4
WIDTHS = (32, 8, 8)  # an attention's q, k and v of GQA: k and v narrower


def _linears(dtype, widths=WIDTHS, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def linear(out):  # PEFT's: the base in the model's dtype, fp32 factors, B past its zero init
        return LoraLinear((torch.randn(out, FEATURES, generator=generator) / FEATURES**0.5).to(dtype),
                          (torch.randn(RANK, FEATURES, generator=generator) / FEATURES**0.5).requires_grad_(),
                          (torch.randn(out, RANK, generator=generator) / RANK**0.5).requires_grad_(), 2.0)

    x = torch.randn(2, 37, FEATURES, generator=generator).to(dtype).requires_grad_()
    return x, [linear(width) for width in widths]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 16, 74, 1000])
def test_the_chunked_linears_match_torch_in_output_and_every_gradient(dtype, chunk_rows):
    x, linears = _linears(dtype)
    trained = [x, *(t for linear in linears for t in (linear.a, linear.b))]
    generator = torch.Generator().manual_seed(5)
    grads_out = [torch.randn(2, 37, width, generator=generator).to(dtype) for width in WIDTHS]
    reference = [lora_linear(x, linear) for linear in linears]
    expected = torch.autograd.grad(reference, trained, grads_out)
    outputs = chunked_lora_linears(x, linears, chunk_rows)
    for output, want in zip(outputs, reference, strict=True):
        assert output.dtype == dtype and output.shape == want.shape
        if dtype == torch.float32:  # the same products on fewer rows: rounding only
            assert float((output - want).detach().abs().max()) <= 1e-6 * float(want.detach().abs().max())
        else:  # the same ops on each chunk's rows, rounded to bf16
            assert torch.equal(output, want)
    got = torch.autograd.grad(outputs, trained, grads_out)
    names = ["x", *(f"{i} {f}" for i in range(len(linears)) for f in "AB")]
    for name, want, have in zip(names, expected, got, strict=True):
        assert have.dtype == want.dtype, name
        if dtype == torch.float32:  # the same products on fewer rows: rounding only
            assert float((have - want).abs().max()) <= 1e-5 * float(want.abs().max()), name
        else:  # bf16: the adapters' terms of d x summed in float32 before one cast, where torch casts each
            cosine = torch.nn.functional.cosine_similarity(have.float().flatten(), want.float().flatten(), 0)
            assert float(cosine) >= 0.9995, name


def test_a_base_in_another_dtype_computes_between_two_casts_as_bitsandbytes_does():
    # QLoRA: float32 inputs (its preparation keeps the hidden states so), the 4-bit base dequantized to its bf16
    # computation dtype; bitsandbytes casts x to it, multiplies, and casts back
    x, linears = _linears(torch.float32)
    linears = [linear._replace(weight=linear.weight.to(torch.bfloat16)) for linear in linears]
    trained = [x, *(t for linear in linears for t in (linear.a, linear.b))]
    generator = torch.Generator().manual_seed(5)
    grads_out = [torch.randn(2, 37, width, generator=generator) for width in WIDTHS]

    def peft_on_bitsandbytes(linear):
        base = (x.to(torch.bfloat16) @ linear.weight.t()).to(torch.float32)
        return base + (x @ linear.a.t()) @ linear.b.t() * linear.scale

    reference = [peft_on_bitsandbytes(linear) for linear in linears]
    expected = torch.autograd.grad(reference, trained, grads_out)
    outputs = chunked_lora_linears(x, linears, 16)
    for output, want in zip(outputs, reference, strict=True):
        assert output.dtype == torch.float32
        assert float((output - want).detach().abs().max()) <= 1e-6 * float(want.detach().abs().max())
    for want, have in zip(expected, torch.autograd.grad(outputs, trained, grads_out), strict=True):
        assert float((have - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_an_unused_output_gets_no_gradient_and_adds_nothing_to_the_others():
    x, linears = _linears(torch.float32)
    q, _, v = chunked_lora_linears(x, linears, 16)
    got = torch.autograd.grad((q.sum() + v.sum()), [x, linears[1].a, linears[1].b], allow_unused=True)
    want = torch.autograd.grad((lora_linear(x, linears[0]).sum() + lora_linear(x, linears[2]).sum()), x)
    assert torch.allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[1] is None and got[2] is None  # k's adapters: no gradient, not a buffer of zeros


def test_a_frozen_input_gets_no_gradient_and_the_adapters_theirs():
    x, linears = _linears(torch.float32)
    x = x.detach()
    trained = [t for linear in linears for t in (linear.a, linear.b)]
    want = torch.autograd.grad([lora_linear(x, linear).sum() for linear in linears], trained)
    outputs = chunked_lora_linears(x, linears, 16)
    got = torch.autograd.grad([output.sum() for output in outputs], trained)
    for have, expected in zip(got, want, strict=True):
        assert torch.allclose(have, expected, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_refused():
    x, linears = _linears(torch.float32)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1; got 0"):
        chunked_lora_linears(x, linears, 0)
    with pytest.raises(ValueError, match="no linear given"):
        chunked_lora_linears(x, [], 8)
    with pytest.raises(ValueError, match="linear 1's base weight trains"):
        chunked_lora_linears(x, [linears[0], linears[1]._replace(weight=linears[1].weight.clone().requires_grad_())],
                             8)
    with pytest.raises(ValueError, match="linear 0 takes 32 features; x has 16"):
        chunked_lora_linears(x[..., :16], linears, 8)
    half = linears[2]._replace(a=linears[2].a.half(), b=linears[2].b.half())
    with pytest.raises(ValueError, match="linear 1's adapter is torch.float16, linear 0's torch.float32"):
        chunked_lora_linears(x, [linears[0], half], 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("widths", [WIDTHS, (8, 32)])
@pytest.mark.parametrize("rows, chunk_rows", [(1024, 256), (1024, 2048)])
@pytest.mark.parametrize("x_trains", [True, False])
def test_the_workspace_is_what_the_op_holds_beyond_its_inputs_and_outputs(dtype, widths, rows, chunk_rows, x_trains):
    _, linears = _linears(dtype, widths)
    x = torch.randn(rows, FEATURES).to(dtype)
    grads_out = [torch.randn(rows, width).to(dtype) for width in widths]
    operands = [list(field) for field in zip(*linears, strict=True)]
    outputs = sum(rows * width * x.element_size() for width in widths)
    accumulators = sum((linear.a.numel() + linear.b.numel()) * 4 for linear in linears)
    forward = peak_memory(lambda: torch.ops.fxmem.chunked_lora_linears(x, *operands, chunk_rows), "cpu") - outputs
    backward = peak_memory(lambda: torch.ops.fxmem.chunked_lora_linears_backward(
        grads_out, x, *operands, chunk_rows, x_trains), "cpu") - (rows * FEATURES * x.element_size() if x_trains
                                                                  else 0) - accumulators
    shape = (rows, chunk_rows, FEATURES, widths, RANK, x.element_size())
    assert forward == workspace_bytes(*shape, backward=False)
    # and, beside them, the LoRA gradients' rank-wide products (at most their accumulators) and, in bf16, a scratch
    # buffer of the CPU's matmuls whatever the rows (measured: 9.6 KiB at most)
    scratch = 16 * 1024 if dtype == torch.bfloat16 else 0
    assert 0 <= backward - workspace_bytes(*shape, backward=True, x_trains=x_trains) <= accumulators + scratch
