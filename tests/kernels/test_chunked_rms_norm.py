import pytest
import torch

from fxmem.kernels.chunked_rms_norm import chunked_rms_norm, rms_norm_reference, workspace_bytes
from fxmem.measure import peak_memory

HIDDEN, EPS = 48, 1e-6


def _inputs(dtype, weight_trains=False, weight_dtype=None):
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 37, HIDDEN, generator=generator)).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=generator)).to(weight_dtype or dtype)
    grad_out = torch.randn(2, 37, HIDDEN, generator=torch.Generator().manual_seed(5))
    return x, weight.requires_grad_(weight_trains), grad_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 16, 74, 1000])
@pytest.mark.parametrize("weight_trains", [False, True])
def test_the_chunked_norm_matches_torch_in_output_and_every_gradient(dtype, chunk_rows, weight_trains):
    x, weight, grad_out = _inputs(dtype, weight_trains)
    grad_out = grad_out.to(dtype)
    trained = [x, weight] if weight_trains else [x]
    reference = rms_norm_reference(x, weight, EPS)
    expected = torch.autograd.grad(reference, trained, grad_out)
    output = chunked_rms_norm(x, weight, EPS, chunk_rows)
    assert torch.equal(output, reference)  # forward: the same ops on each chunk's rows
    got = torch.autograd.grad(output, trained, grad_out)
    for name, want, have in zip(("x", "weight"), expected, got):
        assert have.dtype == want.dtype, name
        if dtype == torch.float32:  # the same sums in another order (8e-8 measured)
            assert float((have - want).abs().max()) <= 1e-6 * float(want.abs().max()), name
        elif name == "x":  # bf16: each row's float32 sums round to the same bf16 value
            assert torch.equal(have, want)
        else:  # summed in float32 across chunks, where torch sums in bf16: within a bf16 rounding
            assert float((have.float() - want.float()).abs().max()) <= 2**-8 * float(want.abs().max())


def test_a_float32_weight_on_a_bf16_input_returns_float32_as_torch_does():
    x, weight, grad_out = _inputs(torch.bfloat16, weight_trains=True, weight_dtype=torch.float32)
    reference = rms_norm_reference(x, weight, EPS)
    output = chunked_rms_norm(x, weight, EPS, 16)
    assert output.dtype == torch.float32 and torch.equal(output, reference)
    expected = torch.autograd.grad(reference, [x, weight], grad_out)
    got = torch.autograd.grad(output, [x, weight], grad_out)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.float32]
    for want, have in zip(expected, got):
        assert float((have.float() - want.float()).abs().max()) <= 1e-2 * float(want.abs().max())


def test_a_frozen_input_gets_no_gradient_computed():
    x, weight, grad_out = _inputs(torch.float32, weight_trains=True)
    x = x.detach()  # a norm on a frozen embedding, its weight trained
    expected = torch.autograd.grad(rms_norm_reference(x, weight, EPS), weight, grad_out)[0]
    grad_x, grad_weight = torch.ops.fxmem.chunked_rms_norm_backward(grad_out, x, weight, EPS, 16, False, True)
    assert grad_x.numel() == 0
    assert float((grad_weight - expected).abs().max()) <= 1e-6 * float(expected.abs().max())
    assert torch.allclose(torch.autograd.grad(chunked_rms_norm(x, weight, EPS, 16), weight, grad_out)[0], grad_weight)


@pytest.mark.parametrize("x_trains, weight_trains", [(True, False), (True, True), (False, True)])
def test_the_ops_pass_torchs_custom_op_checks(x_trains, weight_trains):
    # fake and real outputs alike (shapes, strides, dtypes), autograd registered, and a non-contiguous x
    x, weight, grad_out = _inputs(torch.bfloat16, weight_trains)
    x = x.detach().transpose(0, 1).requires_grad_(x_trains)
    torch.library.opcheck(torch.ops.fxmem.chunked_rms_norm.default, (x, weight, EPS, 16))
    torch.library.opcheck(torch.ops.fxmem.chunked_rms_norm_backward.default,
                          (grad_out.to(torch.bfloat16).transpose(0, 1), x.detach(), weight.detach(), EPS, 16, x_trains,
                           weight_trains))


def test_the_input_is_left_as_it_was():
    x, weight, grad_out = _inputs(torch.float32)  # a float32 x upcasts to itself: backward must not write to it
    before = x.detach().clone()
    chunked_rms_norm(x, weight, EPS, 16).backward(grad_out)
    assert torch.equal(x.detach(), before)


def test_bad_arguments_are_refused():
    x, weight, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1; got 0"):
        chunked_rms_norm(x, weight, EPS, 0)
    with pytest.raises(ValueError, match=r"the weight must be one value per channel, shape \(48,\); got \(47,\)"):
        chunked_rms_norm(x, weight[:47], EPS, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, chunk_rows", [(1024, 256), (1024, 2048)])
def test_the_workspace_is_what_the_op_holds_beyond_its_inputs_and_outputs(dtype, rows, chunk_rows):
    x, weight, grad_out = (torch.randn(rows, HIDDEN).to(dtype), torch.randn(HIDDEN).to(dtype),
                           torch.randn(rows, HIDDEN).to(dtype))
    held = rows * HIDDEN * x.element_size()  # the output, or d x
    forward = peak_memory(lambda: torch.ops.fxmem.chunked_rms_norm(x, weight, EPS, chunk_rows), "cpu") - held
    backward = peak_memory(lambda: torch.ops.fxmem.chunked_rms_norm_backward(grad_out, x, weight, EPS, chunk_rows,
                                                                             True, False), "cpu") - held
    per_row = min(rows, chunk_rows) * 16  # beside them, a few float32 statistics per row
    assert 0 <= forward - workspace_bytes(rows, chunk_rows, HIDDEN, x.element_size(), backward=False) <= per_row
    assert 0 <= backward - workspace_bytes(rows, chunk_rows, HIDDEN, x.element_size(), backward=True) <= per_row
