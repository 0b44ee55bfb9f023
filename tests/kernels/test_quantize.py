"""fxmem::quantize / fxmem::dequantize: the Triton kernels against the torch reference (interpreted on CPU)."""

import math

import pytest
import torch

from fxmem.kernels import quantize as kernels

pytestmark = pytest.mark.skipif(kernels.triton is None, reason="triton is not installed")

SHAPES = [(3, 5, 7), (64, 256), (2, 3, 1), (4, 2, 3, 10)]


def _params(x: torch.Tensor, bits: int, symmetric: bool = False):
    rows = x.reshape(-1, x.shape[-1]).float()
    return kernels.quant_params(rows.amin(0), rows.amax(0), bits, symmetric=symmetric)


@pytest.mark.parametrize("bits", kernels.BITS_CHOICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_kernels_match_the_reference_byte_for_byte(bits, shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(bits)) * 3 + 1).to(dtype)
    scale, zero = _params(x, bits)
    packed = kernels.quantize_reference(x, scale, zero, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(x.numel() * bits / 8)
    assert torch.equal(kernels.quantize_triton(x, scale, zero, bits), packed)
    restored = kernels.dequantize_reference(packed, scale, zero, bits, shape, dtype)
    assert restored.dtype == dtype
    from_triton = kernels.dequantize_triton(packed, scale, zero, bits, shape, dtype)
    if dtype == torch.bfloat16:  # the interpreter (numpy) truncates float32 -> bfloat16; torch and CUDA round
        torch.testing.assert_close(from_triton, restored, rtol=2**-7, atol=0)
    else:
        assert torch.equal(from_triton, restored)


def test_two_bit_codes_pack_four_to_a_byte_first_value_lowest():
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 1.0]]).T.repeat(1, 1).reshape(5, 1)  # one channel, five values
    scale, zero = torch.ones(1), torch.zeros(1)
    packed = kernels.quantize_reference(x, scale, zero, 2)
    assert packed.tolist() == [0 | 1 << 2 | 2 << 4 | 3 << 6, 1]


@pytest.mark.parametrize("bits, symmetric", [(b, False) for b in kernels.BITS_CHOICES] + [(b, True) for b in (2, 4, 8)])
def test_round_trip_error_is_at_most_half_a_step(bits, symmetric):
    x = torch.randn(128, 16, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 10, 16)
    scale, zero = _params(x, bits, symmetric)
    restored = kernels.dequantize_reference(kernels.quantize_reference(x, scale, zero, bits), scale, zero, bits,
                                            x.shape, x.dtype)
    assert ((restored - x).abs() <= scale / 2 * (1 + 1e-5) + 1e-6).all()


def test_symmetric_zero_is_the_middle_code_and_one_bit_is_refused():
    scale, zero = kernels.quant_params(torch.tensor([-2.0]), torch.tensor([1.0]), 4, symmetric=True)
    assert zero.item() == 8 and scale.item() == pytest.approx(2 / 7)
    with pytest.raises(ValueError, match="symmetric quantization needs at least 2 bits"):
        kernels.quant_params(torch.tensor([-1.0]), torch.tensor([1.0]), 1, symmetric=True)
    with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8; got 3"):
        kernels.quant_params(torch.tensor([-1.0]), torch.tensor([1.0]), 3)


@pytest.mark.parametrize("bits", kernels.BITS_CHOICES)
def test_constant_channels_come_back_exactly(bits):
    x = torch.tensor([[3.5, -2.0, 0.0, 1e-30]]).repeat(6, 1)
    scale, zero = _params(x, bits)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    restored = kernels.dequantize_reference(kernels.quantize_reference(x, scale, zero, bits), scale, zero, bits,
                                            x.shape, x.dtype)
    assert torch.equal(restored, x)


def test_non_finite_values_and_bounds_never_produce_nan():
    x = torch.randn(8, 4)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), float("-inf")
    scale, zero = kernels.quant_params(torch.tensor([float("nan"), -1, float("-inf"), 0]),
                                       torch.tensor([float("inf"), 1, 2, float("nan")]), 4)
    assert torch.isfinite(scale).all() and torch.isfinite(zero).all()
    for quantize, dequantize in [(kernels.quantize_reference, kernels.dequantize_reference),
                                 (kernels.quantize_triton, kernels.dequantize_triton)]:
        restored = dequantize(quantize(x, scale, zero, 4), scale, zero, 4, x.shape, x.dtype)
        assert torch.isfinite(restored).all()


def test_outlier_channels_are_restored_exactly_through_the_ops():
    x = torch.randn(2, 10, 32, generator=torch.Generator().manual_seed(3))
    x[..., 5] *= 100
    scale, zero = _params(x, 2)
    ids = torch.tensor([5, 17])
    packed, outliers = torch.ops.fxmem.quantize(x, scale, zero, ids, 2)
    assert outliers.shape == (2, 10, 2) and packed.numel() == x.numel() // 4
    restored = torch.ops.fxmem.dequantize(packed, outliers, scale, zero, ids, 2)
    assert torch.equal(restored[..., ids], x[..., ids])
    others = [c for c in range(32) if c not in (5, 17)]
    assert ((restored - x)[..., others].abs() <= scale[others] / 2 * (1 + 1e-5)).all()


def test_custom_ops_pass_opcheck():
    x = torch.randn(4, 6, 8)
    scale, zero = _params(x, 4)
    ids = torch.tensor([1])
    torch.library.opcheck(torch.ops.fxmem.quantize.default, (x, scale, zero, ids, 4))
    packed, outliers = torch.ops.fxmem.quantize(x, scale, zero, ids, 4)
    torch.library.opcheck(torch.ops.fxmem.dequantize.default, (packed, outliers, scale, zero, ids, 4))


@pytest.mark.parametrize("shape", [(64, 256), (4, 50, 48), (3, 700)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outlier_values_are_the_values_farthest_from_their_channel_mean(shape, dtype):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) ** 3).to(dtype)  # heavy tails
    count = kernels.outlier_value_count(x.numel(), 0.01)
    rest, positions, values = kernels.split_outlier_values(x, count)
    rows = x.reshape(-1, shape[-1]).float()
    deviation = ((rows - rows.mean(0)) / rows.std(0, correction=0)).abs().reshape(-1)
    ranked = deviation.sort(descending=True).values
    assert positions.unique().numel() == count  # the count farthest (up to rounding at the boundary)
    assert deviation[positions.long()].min() >= ranked[count] * (1 - 1e-5)
    assert positions.dtype == torch.int32 and values.dtype == dtype
    assert torch.equal(values, x.reshape(-1)[positions.long()])
    channel_means = rows.mean(0).to(dtype)[positions.long() % shape[-1]]
    torch.testing.assert_close(rest.reshape(-1)[positions.long()], channel_means)
    untouched = torch.ones(x.numel(), dtype=torch.bool)
    untouched[positions.long()] = False
    assert torch.equal(rest.reshape(-1)[untouched], x.reshape(-1)[untouched])


def test_largest_is_exact_where_the_sampled_quantile_overshoots():
    values = torch.rand(64 * 100)
    values[::64] += 10  # every sampled value is large, yet only 100 are: too few candidates for 1000
    assert set(kernels._largest(values, 1000).tolist()) == set(values.topk(1000).indices.tolist())
    assert set(kernels._largest(values, 50).tolist()) == set(values.topk(50).indices.tolist())


def test_outlier_value_count_is_integer_arithmetic_on_the_size():
    assert [kernels.outlier_value_count(n, 0.01) for n in (99, 100, 6291456)] == [0, 1, 62914]
    assert kernels.outlier_value_count(1000, 0.0) == 0


def test_dequantize_with_outlier_values_passes_opcheck_and_restores_them():
    x = torch.randn(4, 6, 8)
    scale, zero = _params(x, 4)
    ids = torch.tensor([], dtype=torch.long)
    packed, outliers = torch.ops.fxmem.quantize(x, scale, zero, ids, 4)
    positions, values = torch.tensor([0, 17, 191], dtype=torch.int32), torch.tensor([9.0, -9.0, 0.5])
    args = (packed, outliers, scale, zero, ids, 4, positions, values)
    torch.library.opcheck(torch.ops.fxmem.dequantize.default, args)
    restored = torch.ops.fxmem.dequantize(*args).reshape(-1)
    assert restored[[0, 17, 191]].tolist() == [9.0, -9.0, 0.5]


def test_outlier_values_refuse_a_tensor_their_int32_positions_cannot_address():
    with pytest.raises(ValueError, match="at most 2\\^31 values.*set outlier_values=0"):
        kernels.split_outlier_values(torch.empty(2**31, device="meta"), 10)
