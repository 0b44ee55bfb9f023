"""fxmem::lora_{swiglu,gelu}_{forward,backward}: the torch references against autograd of the plain composition,
and the Triton kernels (interpreted on CPU) against the references."""

import pytest
import torch
import torch.nn.functional as F

from fxmem.kernels import lora_epilogue as epilogue
from fxmem.kernels.quantize import pack, quant_params, unpack

needs_triton = pytest.mark.skipif(epilogue.triton is None, reason="triton is not installed")
# The kernels run compiled on a GPU, and interpreted on CPU tensors without one (tests/conftest.py).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_kernel_device(args: tuple) -> tuple:
    return tuple(a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args)

# (grad shape, r): rows and channels off the 32 x 64 tile; r below, at and past the kernels' step of 16 (40: three
# steps, the last partial); 23 channels fill no whole number of bytes at 1, 2 or 4 bits (the last plane ends in
# padding).
CASES = [((5, 24), 8), ((37, 40), 12), ((2, 5, 40), 16), ((9, 23), 8), ((33, 70), 40)]


def _linear(shape: tuple[int, ...], rank: int, bits: int, seed: int, dtype: torch.dtype = torch.float32,
            b_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """One LoRA linear's backward inputs: Y_W (n x o) quantized per channel, XA (n x r) and B (o x r)."""
    generator = torch.Generator().manual_seed(seed)
    channels = shape[-1]
    rows = torch.Size(shape).numel() // channels
    y_w = torch.randn(rows, channels, generator=generator) * 2
    scale, zero = quant_params(y_w.amin(0), y_w.amax(0), bits)
    return {"packed": pack(y_w, scale, zero, bits), "scale": scale, "zero": zero,
            "xa": torch.randn(rows, rank, generator=generator).to(dtype),
            "b": (torch.randn(channels, rank, generator=generator) / rank**0.5).to(b_dtype or dtype)}


def _rebuilt(linear: dict[str, torch.Tensor], scaling: float, bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The plain composition: unpack, then the LoRA term by torch's mm."""
    y_w = unpack(linear["packed"], linear["scale"], linear["zero"], bits, shape[-1])
    return (y_w + scaling * (linear["xa"].float() @ linear["b"].float().t())).reshape(shape)


def _swiglu_args(grad_h, gate, up, bits, gate_scaling=2.0, up_scaling=0.5):
    return (grad_h, gate["packed"], gate["scale"], gate["zero"], gate["xa"], gate["b"], gate_scaling,
            up["packed"], up["scale"], up["zero"], up["xa"], up["b"], up_scaling, bits)


def _gelu_args(grad_a, linear, bits, approximate, scaling=2.0):
    return (grad_a, linear["packed"], linear["scale"], linear["zero"], linear["xa"], linear["b"], scaling, bits,
            approximate)


@pytest.mark.parametrize("bits", [1, 4])
@pytest.mark.parametrize("shape, rank", CASES)
def test_swiglu_backward_reference_is_autograd_of_the_composition(bits, shape, rank):
    gate, up = _linear(shape, rank, bits, 0), _linear(shape, rank, bits, 1)
    grad_h = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    gate_y = _rebuilt(gate, 2.0, bits, shape).requires_grad_()
    up_y = _rebuilt(up, 0.5, bits, shape).requires_grad_()
    h = F.silu(gate_y) * up_y
    expected = (*torch.autograd.grad(h, (gate_y, up_y), grad_h), h.detach())
    got = torch.ops.fxmem.lora_swiglu_backward(*_swiglu_args(grad_h, gate, up, bits))
    for g, e in zip(got, expected, strict=True):
        assert g.shape == shape
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize("approximate", epilogue.GELU_APPROXIMATIONS)
@pytest.mark.parametrize("shape, rank", CASES)
def test_gelu_backward_reference_is_autograd_of_the_composition(approximate, shape, rank):
    bits = 2
    linear = _linear(shape, rank, bits, 0)
    grad_a = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    y = _rebuilt(linear, 2.0, bits, shape).requires_grad_()
    a = F.gelu(y, approximate=approximate)
    (grad_y,) = torch.autograd.grad(a, y, grad_a)
    got_grad_y, got_a = torch.ops.fxmem.lora_gelu_backward(*_gelu_args(grad_a, linear, bits, approximate))
    torch.testing.assert_close(got_grad_y, grad_y)
    torch.testing.assert_close(got_a, a.detach())


@pytest.mark.parametrize("shape, rank", CASES)
def test_forward_references_are_the_composition(shape, rank):
    generator = torch.Generator().manual_seed(0)
    gate_base, up_base = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    gate, up = _linear(shape, rank, 8, 1), _linear(shape, rank, 8, 2)

    def lora(linear, scaling):
        return (scaling * (linear["xa"] @ linear["b"].t())).reshape(shape)

    h = torch.ops.fxmem.lora_swiglu_forward(gate_base, gate["xa"], gate["b"], 2.0, up_base, up["xa"], up["b"], 0.5)
    torch.testing.assert_close(h, F.silu(gate_base + lora(gate, 2.0)) * (up_base + lora(up, 0.5)))
    for approximate in epilogue.GELU_APPROXIMATIONS:
        a = torch.ops.fxmem.lora_gelu_forward(gate_base, gate["xa"], gate["b"], 2.0, approximate)
        torch.testing.assert_close(a, F.gelu(gate_base + lora(gate, 2.0), approximate=approximate))


# The interpreter (numpy) truncates float32 -> bfloat16 where torch rounds: one bf16 step apart at most, plus fp32
# summation-order noise that may land a value on the other side of a rounding boundary.
def _assert_matches(got: torch.Tensor, expected: torch.Tensor) -> None:
    got = got.cpu()
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-5)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# (activations, LoRA factors): one dtype, or PEFT's fp32 adapters on a bf16 model
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@needs_triton
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape, rank", CASES)
def test_swiglu_backward_kernel_matches_the_reference(dtypes, bits, shape, rank):
    activations, factors = dtypes
    gate, up = _linear(shape, rank, bits, 0, factors), _linear(shape, rank, bits, 1, factors)
    grad_h = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(activations)
    args = _swiglu_args(grad_h, gate, up, bits)
    for got, expected in zip(epilogue.lora_swiglu_backward_triton(*_on_kernel_device(args)),
                             epilogue.lora_swiglu_backward_reference(*args), strict=True):
        _assert_matches(got, expected)


@needs_triton
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("approximate", epilogue.GELU_APPROXIMATIONS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape, rank", CASES)
def test_gelu_backward_kernel_matches_the_reference(dtypes, approximate, bits, shape, rank):
    activations, factors = dtypes
    linear = _linear(shape, rank, bits, 0, factors)
    grad_a = torch.randn(shape, generator=torch.Generator().manual_seed(2)).to(activations)
    args = _gelu_args(grad_a, linear, bits, approximate)
    for got, expected in zip(epilogue.lora_gelu_backward_triton(*_on_kernel_device(args)),
                             epilogue.lora_gelu_backward_reference(*args), strict=True):
        _assert_matches(got, expected)


@needs_triton
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("shape, rank", CASES)
def test_forward_kernels_match_the_references(dtypes, shape, rank):
    activations, factors = dtypes
    generator = torch.Generator().manual_seed(0)
    gate_base, up_base = (torch.randn(shape, generator=generator).to(activations) * 2 for _ in range(2))
    gate, up = _linear(shape, rank, 8, 1, factors), _linear(shape, rank, 8, 2, factors)
    swiglu = (gate_base, gate["xa"], gate["b"], 2.0, up_base, up["xa"], up["b"], 0.5)
    _assert_matches(epilogue.lora_swiglu_forward_triton(*_on_kernel_device(swiglu)),
                    epilogue.lora_swiglu_forward_reference(*swiglu))
    for approximate in epilogue.GELU_APPROXIMATIONS:
        gelu = (gate_base, gate["xa"], gate["b"], 2.0, approximate)
        _assert_matches(epilogue.lora_gelu_forward_triton(*_on_kernel_device(gelu)),
                        epilogue.lora_gelu_forward_reference(*gelu))


@needs_triton
def test_kernels_take_bf16_activations_with_an_fp32_lora_b():
    shape, rank, bits = (37, 40), 12, 4
    gate = _linear(shape, rank, bits, 0, torch.bfloat16, torch.float32)
    up = _linear(shape, rank, bits, 1, torch.bfloat16, torch.float32)
    grad_h = torch.randn(shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    args = _swiglu_args(grad_h, gate, up, bits)
    for got, expected in zip(epilogue.lora_swiglu_backward_triton(*_on_kernel_device(args)),
                             epilogue.lora_swiglu_backward_reference(*args), strict=True):
        _assert_matches(got, expected)


@needs_triton
def test_every_launch_is_guarded_to_its_tensors_device(monkeypatch):
    # Triton launches on the current device; on a multi-GPU node that need not be the tensors'.
    import contextlib
    guarded = []

    def guard(t):
        guarded.append(t.device)
        return contextlib.nullcontext()

    monkeypatch.setattr(epilogue, "_on_device", guard)
    shape, rank, bits = (5, 24), 8, 4
    gate, up = _linear(shape, rank, bits, 0), _linear(shape, rank, bits, 1)
    grad = torch.randn(shape)
    calls = [(epilogue.lora_swiglu_backward_triton, _swiglu_args(grad, gate, up, bits)),
             (epilogue.lora_gelu_backward_triton, _gelu_args(grad, gate, bits, "none")),
             (epilogue.lora_swiglu_forward_triton, (grad, gate["xa"], gate["b"], 2.0, grad, up["xa"], up["b"], 0.5)),
             (epilogue.lora_gelu_forward_triton, (grad, gate["xa"], gate["b"], 2.0, "none"))]
    for function, args in calls:
        guarded.clear()
        function(*_on_kernel_device(args))
        assert guarded == [torch.device(KERNEL_DEVICE, 0) if KERNEL_DEVICE == "cuda" else torch.device("cpu")]


def test_bad_inputs_are_refused_with_the_valid_choices():
    shape, rank = (5, 24), 8
    gate, up = _linear(shape, rank, 4, 0), _linear(shape, rank, 4, 1)
    grad = torch.randn(shape)
    with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8; got 3"):
        torch.ops.fxmem.lora_swiglu_backward(*_swiglu_args(grad, gate, up, 3))
    with pytest.raises(ValueError, match="approximate must be one of 'none', 'tanh'; got 'erf'"):
        torch.ops.fxmem.lora_gelu_backward(*_gelu_args(grad, gate, 4, "erf"))
    with pytest.raises(ValueError, match="approximate must be one of 'none', 'tanh'; got 'exact'"):
        torch.ops.fxmem.lora_gelu_forward(grad, gate["xa"], gate["b"], 1.0, "exact")
    with pytest.raises(ValueError, match=r"gate_packed must hold 30 contiguous bytes \(5 x 24 codes of 2 bits\)"):
        torch.ops.fxmem.lora_swiglu_backward(*_swiglu_args(grad, gate, up, 2))
    with pytest.raises(ValueError, match=r"up_xa must be \(rows, r\) = \(5, r\); got shape \(4, 8\)"):
        torch.ops.fxmem.lora_swiglu_backward(*_swiglu_args(grad, gate, {**up, "xa": up["xa"][:4]}, 4))
    with pytest.raises(ValueError, match=r"b must be \(channels, r\) = \(24, 8\); got shape \(24, 7\)"):
        torch.ops.fxmem.lora_gelu_backward(*_gelu_args(grad, {**gate, "b": gate["b"][:, :7]}, 4, "none"))
    with pytest.raises(ValueError, match=r"gate_scale and gate_zero must have one value per channel \(24\)"):
        torch.ops.fxmem.lora_swiglu_backward(*_swiglu_args(grad, {**gate, "scale": gate["scale"][:3]}, up, 4))
    with pytest.raises(ValueError, match=r"up_base must have shape \(5, 24\); got \(5, 23\)"):
        torch.ops.fxmem.lora_swiglu_forward(grad, gate["xa"], gate["b"], 1.0, grad[:, :23], up["xa"], up["b"], 1.0)


def test_custom_ops_pass_opcheck():
    shape, rank, bits = (2, 3, 24), 8, 4
    gate, up = _linear(shape, rank, bits, 0), _linear(shape, rank, bits, 1)
    grad = torch.randn(shape)
    torch.library.opcheck(torch.ops.fxmem.lora_swiglu_backward.default, _swiglu_args(grad, gate, up, bits))
    torch.library.opcheck(torch.ops.fxmem.lora_gelu_backward.default, _gelu_args(grad, gate, bits, "tanh"))
    torch.library.opcheck(torch.ops.fxmem.lora_swiglu_forward.default,
                          (grad, gate["xa"], gate["b"], 2.0, grad * 2, up["xa"], up["b"], 0.5))
    torch.library.opcheck(torch.ops.fxmem.lora_gelu_forward.default, (grad, gate["xa"], gate["b"], 2.0, "none"))
