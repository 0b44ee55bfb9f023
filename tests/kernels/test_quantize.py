"""fxmem.kernels.quantize: the formulas against plain references, and inductor's code for them against eager."""

import pytest
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.kernels import quantize as q


def _params(x: torch.Tensor, bits: int):
    low, high, *_ = q.channel_stats(x)
    return q.quant_params(low, high, bits)


def _codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Equation (1) element by element, as Python numbers: the reference the packed bytes are read against."""
    return torch.tensor([[min(max(int((float(v) / float(s) + float(z) + 0.5) // 1), 0), 2**bits - 1)
                          for v, s, z in zip(row, scale, zero, strict=True)] for row in x.reshape(-1, x.shape[-1])])


@pytest.mark.parametrize("bits", q.BITS_CHOICES)
@pytest.mark.parametrize("channels", [8, 7, 9, 1])
def test_codes_are_packed_in_planes_byte_j_holding_channels_j_j_plus_w_and_on_first_in_the_lowest_bits(bits, channels):
    x = torch.randn(3, channels, generator=torch.Generator().manual_seed(bits)) * 3 + 1
    scale, zero = _params(x, bits)
    packed = q.pack(x, scale, zero, bits)
    width = q.packed_width(channels, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, width)
    codes = _codes(x, scale, zero, bits)
    for row in range(3):
        for channel in range(channels):
            byte = int(packed[row, channel % width])
            assert (byte >> (channel // width * bits)) & (2**bits - 1) == codes[row, channel]
        for slot in range(channels, width * 8 // bits):  # padding: zero codes
            assert (int(packed[row, slot % width]) >> (slot // width * bits)) & (2**bits - 1) == 0


@pytest.mark.parametrize("bits", q.BITS_CHOICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_at_most_half_a_step_in_the_grid_and_the_rest_is_clamped_to_its_ends(bits, dtype):
    x = (torch.randn(4, 32, 16, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 10, 16)).to(dtype)
    parts = q.quantize(x, q.QuantSpec(16, bits))
    restored = q.dequantize(parts, q.QuantSpec(16, bits), dtype)
    assert restored.dtype == dtype and restored.shape == x.shape
    _, scale, zero, *_ = parts
    low, high = -zero * scale, (2**bits - 1 - zero) * scale  # the grid's ends
    expected = x.float().clamp(low, high)
    rounding = 0 if dtype == torch.float32 else x.abs().float() * 2**-7  # the restored value in x's dtype
    assert ((restored.float() - expected).abs() <= scale / 2 * (1 + 1e-5) + 1e-5 + rounding).all()
    clamped = (x.float() < low - scale) | (x.float() > high + scale)  # the zero point rounds the ends to the grid
    assert clamped.any() == q.fits_range(bits)  # only a fitted grid leaves values outside (Gaussian channels)


def _squared_errors(x: torch.Tensor, lows: torch.Tensor, highs: torch.Tensor, bits: int) -> torch.Tensor:
    """Each candidate grid's squared error per channel over the rows the fit reads, value by value."""
    rows = x[::q.FIT_ROW_STRIDE]
    errors = torch.zeros(lows.shape)
    for k in range(lows.shape[0]):
        scale, zero = q.quant_params(lows[k], highs[k], bits)
        codes = _codes(rows, scale, zero, bits).float()
        errors[k] = ((codes - zero) * scale - rows).square().sum(0)
    return errors


@pytest.mark.parametrize("bits", sorted(q.FITTED_SPREADS))
def test_a_fitted_range_is_the_candidate_grid_with_the_least_squared_error(bits):
    g = torch.Generator().manual_seed(bits)
    gaussian, uniform = torch.randn(512, generator=g), torch.rand(512, generator=g) * 4 - 2
    spiky = torch.randn(512, generator=g) * 0.01
    spiky[::64] = 5.0  # mostly near 0, a few far values: the whole range keeps them
    x = torch.stack([gaussian, uniform, spiky, torch.full((512,), 3.0)], 1)
    low, high, mean, std, _ = q.channel_stats(x)
    chosen_low, chosen_high = q.fitted_range(x, low, high, mean, std, bits)
    spreads = q.FITTED_SPREADS[bits]
    lows = torch.stack([low, *(torch.maximum(low, mean - k * std) for k in spreads)])
    highs = torch.stack([high, *(torch.minimum(high, mean + k * std) for k in spreads)])
    errors = _squared_errors(x, lows, highs, bits)
    best = errors.argmin(0)
    torch.testing.assert_close(chosen_low, lows.gather(0, best[None])[0])
    torch.testing.assert_close(chosen_high, highs.gather(0, best[None])[0])
    assert best[0] != 0  # a Gaussian channel is clamped
    assert chosen_low[3] == chosen_high[3] == 3.0  # a constant channel: every candidate is the value
    if bits == 2:  # (two levels are best inside a uniform channel's range, at +-1/2 of it)
        assert best[1] == 0 and best[2] == 0  # a uniform channel, and far spikes: the whole range


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channel_statistics_keep_a_small_spread_about_a_large_mean(dtype):
    """E[x^2] - mean^2 in fp32 gives std 0 for a channel of mean 1000 and std 0.05 (the sums' rounding is 0.06);
    the shifted sums keep it, whatever the activation's dtype."""
    g = torch.Generator().manual_seed(0)
    x = torch.stack([1000 + 0.05 * torch.randn(4096, generator=g), torch.randn(4096, generator=g)], 1)
    x = x.to(dtype)
    exact = x.double()
    _, _, mean, std, square_norm = q.channel_stats(x)
    torch.testing.assert_close(std.double(), exact.std(0, unbiased=False), rtol=1e-3, atol=0)
    torch.testing.assert_close(mean.double(), exact.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(square_norm.double(), exact.square().sum(0), rtol=1e-5, atol=0)
    naive = (x.float().square().mean(0) - x.float().mean(0).square()).clamp_min(0).sqrt()
    assert naive[0] == 0 or abs(naive[0] / exact[:, 0].std(unbiased=False) - 1) > 0.1  # what the shift fixes


@pytest.mark.parametrize("shape", [(7,), (3, 7), (2, 3, 7)])
def test_channel_statistics_reduce_every_dimension_but_the_last(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    rows = x.reshape(-1, shape[-1]).double()
    low, high, mean, std, square_norm = q.channel_stats(x)
    assert all(t.shape == (shape[-1],) for t in (low, high, mean, std, square_norm))
    torch.testing.assert_close(low.double(), rows.amin(0))
    torch.testing.assert_close(high.double(), rows.amax(0))
    torch.testing.assert_close(mean.double(), rows.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(std.double(), rows.std(0, unbiased=False), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(square_norm.double(), rows.square().sum(0), rtol=1e-5, atol=1e-6)


def test_a_constant_channel_comes_back_exactly_and_bits_are_checked():
    x = torch.tensor([[2.5, 0.0, -1.0], [2.5, 0.0, 3.0]])
    spec = q.QuantSpec(3, 2)
    restored = q.dequantize(q.quantize(x, spec), spec, x.dtype)
    assert restored[:, 0].tolist() == [2.5, 2.5] and restored[:, 1].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="bits must be one of 1, 2, 4, 8; got 3"):
        q.QuantSpec(4, 3)
    with pytest.raises(ValueError, match="chunk must be a power of two up to 256"):
        q.QuantSpec(4, 4, chunk=48)


def test_outlier_channels_come_back_exactly():
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    x[:, 5] *= 100
    spec = q.QuantSpec(16, 2, outliers=2)
    parts = q.quantize(x, spec)
    assert 5 in parts[3].tolist() and parts[4].shape == (64, 2)
    restored = q.dequantize(parts, spec, x.dtype)
    assert torch.equal(restored[:, parts[3]], x[:, parts[3]])


@pytest.mark.parametrize("channels", [64, 40])  # 40: a last chunk of padding
def test_each_chunk_keeps_its_farthest_value_exactly(channels):
    x = torch.randn(32, channels, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.5, 4, channels)
    x[3, 7] = 80.0
    x[9, 20] = float("nan")
    spec = q.QuantSpec(channels, 2, chunk=16)
    low, high, mean, std, _ = q.channel_stats(x)
    index, values = q.select_outlier_values(x, mean, std, 16)
    assert index.dtype == torch.uint8 and index.shape == (32, -(-channels // 16))
    deviation = ((x - mean) / std).abs().nan_to_num(float("inf"))
    padded = torch.nn.functional.pad(deviation, (0, -channels % 16), value=-1.0)
    assert torch.equal(index.long(), padded.reshape(32, -1, 16).argmax(-1))
    restored = q.dequantize(q.quantize(x, spec), spec, x.dtype)
    kept = torch.zeros_like(x, dtype=torch.bool)
    kept.scatter_(1, (index.long() + torch.arange(0, channels, 16)).clamp_max(channels - 1), True)
    assert torch.equal(restored[kept].nan_to_num(-1.0), x[kept].nan_to_num(-1.0))  # the NaN, exactly
    assert restored[3, 7] == 80.0 and restored[9, 20].isnan()
    # the rest: on the fitted grid, clamped to its ends
    _, scale, zero, *_ = q.quantize(x, spec)
    inside = ~kept & (x >= -zero * scale) & (x <= (3 - zero) * scale)
    assert ((restored - x).abs()[inside] <= (scale / 2 * (1 + 1e-5)).expand_as(x)[inside]).all()


def test_outlier_chunk_is_the_power_of_two_nearest_the_ratio():
    assert [q.outlier_chunk(r) for r in (0.0, 0.02, 0.01, 0.1, 0.4)] == [0, 64, 128, 8, 2]


@pytest.mark.parametrize("bits", [4, 2])  # 2: a fitted range
def test_the_traced_formulas_have_no_host_sync_and_no_data_dependent_size(bits):
    spec = q.QuantSpec(64, bits, outliers=1, chunk=64)
    x = torch.randn(8, 5, 64)
    traced = make_fx(lambda t: q.quantize(t, spec), tracing_mode="symbolic")(x)
    aten = torch.ops.aten
    syncing = {aten.nonzero.default, aten.item.default, aten._local_scalar_dense.default, aten.masked_select.default}
    assert not {n.target for n in traced.graph.nodes} & syncing
    sizes = [n.meta["val"].shape for n in traced.graph.nodes if n.op == "output" for n in n.args[0]]
    assert all(str(s[0]) == str(sizes[0][0]) for s in sizes[:1] + sizes[4:])  # rows stay the input's symbol


def _kernels(code: str) -> list[str]:
    """The names of the C++ kernels inductor generated: cpp_fused_<the ops it fused>_<n>."""
    return [line.split("=")[0].strip() for line in code.splitlines() if "= async_compile.cpp_pybinding(" in line]


def _source(code: str, kernel: str) -> str:
    return code.split(f"{kernel} = ")[1].split("''')")[0]


def test_inductor_fuses_the_statistics_into_the_producers_kernel_and_unpacks_in_the_consumers_bit_for_bit():
    spec = q.QuantSpec(256, 4)
    a, b, grad = (torch.randn(128, 256, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def forward(a, b):
        y = torch.nn.functional.silu(a) * b
        return (y, *q.quantize(y, spec))

    def backward(grad, *parts):
        return grad * torch.sigmoid(q.dequantize(parts, spec, torch.float32))

    eager = forward(a, b)
    compiled, (code,) = run_and_get_code(torch.compile(forward), a, b)
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)  # min/max statistics: no summation order to differ in
    # One kernel: y, its per-channel statistics, and (in one more loop over y: the codes need the statistics of
    # every row) the packed codes; nothing else runs.
    [producer] = _kernels(code)
    assert all(op in producer for op in ("silu", "amax", "amin", "floor", "clamp")), producer
    call = code.split("def call(")[1].split("\ndef ")[0]
    assert "extern_kernels." not in call and "aten." not in call
    vectorized = bool(pick_vec_isa())  # the planes' layout is there for inductor's vectorized C++
    assert not vectorized or "at::vec::convert<uint8_t>" in _source(code, producer)
    restored, (code,) = run_and_get_code(torch.compile(backward), grad, *eager[1:])
    torch.testing.assert_close(restored, backward(grad, *eager[1:]), rtol=1e-6, atol=1e-6)
    # Unpacking, scaling and the consumer: one kernel, whose first loop writes the planes' codes side by side
    # (inductor's C++ concatenates into a buffer) and whose second computes the consumer from them.
    [consumer] = _kernels(code)
    assert "floor" in consumer and "sigmoid" in consumer, consumer
    source = _source(code, consumer)
    assert source.count("#pragma omp for") == 2, source
    assert not vectorized or "at::vec::Vectorized<uint8_t>::loadu" in source


def test_inductor_fits_a_2_bit_range_inside_the_producers_kernel():
    spec = q.QuantSpec(256, 2, chunk=64)
    a, b = (torch.randn(128, 256, generator=torch.Generator().manual_seed(i)) for i in range(2))

    def forward(a, b):
        y = torch.nn.functional.silu(a) * b
        return (y, *q.quantize(y, spec))

    eager = forward(a, b)
    compiled, (code,) = run_and_get_code(torch.compile(forward), a, b)
    assert torch.equal(compiled[1], eager[1])  # the packed codes
    torch.testing.assert_close(compiled[2], eager[2])  # scales: std is a sum, whose order inductor may change
    [producer] = _kernels(code)  # y, statistics, the fit (its argmin), outlier values and codes: one kernel
    assert all(op in producer for op in ("silu", "argmin", "floor", "gather")), producer
    call = code.split("def call(")[1].split("\ndef ")[0]
    assert "extern_kernels." not in call and "aten." not in call


@pytest.mark.parametrize("block", [8, 64, 256])
def test_the_hadamard_rotation_is_orthogonal_with_entries_plus_or_minus_one_over_root_block(block):
    rotation = q.hadamard_rotation(block, "cpu")
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(block), rtol=0, atol=1e-6)
    assert set((rotation * block**0.5).round().unique().tolist()) == {-1.0, 1.0}
    signs = (rotation[:, 0] > 0).int()  # H's first column is all ones: the row signs, about half flipped
    assert 0.3 < signs.float().mean() < 0.7 or block == 8
    x = torch.randn(3, 5, 2 * block, generator=torch.Generator().manual_seed(block))
    torch.testing.assert_close(q.rotate(q.rotate(x, block), block, inverse=True), x, rtol=0, atol=1e-5)


def test_rotation_spreads_a_rows_outlier_over_its_block_and_restores_it_with_less_error():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 128, generator=g)
    rows = torch.arange(256)
    x[rows, torch.randint(0, 128, (256,), generator=g)] = 40.0  # one far value per row, in any channel
    errors = {}
    for block in (0, 64):
        spec = q.QuantSpec(128, 2, rotation=block)
        restored = q.dequantize(q.quantize(x, spec), spec, x.dtype)
        errors[block] = ((restored - x).norm() / x.norm()).item()
    assert errors[64] < 0.6 * errors[0], errors


def test_rotation_blocks_divide_the_channels_and_bad_specs_are_refused():
    assert q.rotation_block(688, 64) == 16 and q.rotation_block(256, 64) == 64 and q.rotation_block(12, 64) == 0
    with pytest.raises(ValueError, match=r"rotation must be a power of two that divides the channels \(96\); got 64"):
        q.QuantSpec(96, 2, rotation=64)
    with pytest.raises(ValueError, match="rotation must be a power of two"):
        q.QuantSpec(96, 2, rotation=24)


def test_stochastic_rounding_is_unbiased_where_rounding_to_nearest_is_not():
    x = torch.tensor([[0.0], [3.0], [1.25]])  # a channel of range [0, 3]: at 4 bits, levels 0.2 apart
    spec, nearest = q.QuantSpec(1, 4, stochastic=True), q.QuantSpec(1, 4)
    torch.manual_seed(0)
    draws = torch.stack([q.dequantize(q.quantize(x, spec), spec, x.dtype)[2, 0] for _ in range(2000)])
    torch.testing.assert_close(draws.unique(), torch.tensor([1.2, 1.4]))  # the levels around it, nothing else
    assert abs(draws.mean().item() - 1.25) < 0.005  # 1.4 a quarter of the time
    torch.testing.assert_close(q.dequantize(q.quantize(x, nearest), nearest, x.dtype)[2, 0], torch.tensor(1.2))


def test_inductor_rotates_and_rounds_stochastically_as_eager_does():
    spec = q.QuantSpec(128, 2, chunk=64, rotation=64, stochastic=True)
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))

    def round_trip(t):
        return q.dequantize(q.quantize(t, spec), spec, t.dtype)

    exact = q.dequantize(q.quantize(x, q.QuantSpec(128, 8, rotation=64)), q.QuantSpec(128, 8, rotation=64), x.dtype)
    compiled = torch.compile(round_trip)(x)
    eager = round_trip(x)
    # Different random draws, the same distribution: each within a step of the value, errors of one size.
    for restored in (compiled, eager):
        assert ((restored - x).norm() / x.norm()).item() < 0.75
    assert abs((compiled - x).norm() / (eager - x).norm() - 1) < 0.1
    torch.testing.assert_close(exact, x, rtol=0, atol=0.05)  # at 8 bits rotation round-trips to the grid's step


@pytest.mark.parametrize("bits", [2, 4])
def test_positive_values_stay_positive_and_zero_exact_each_within_a_step(bits):
    generator = torch.Generator().manual_seed(6)
    relu = torch.relu(torch.randn(256, 32, generator=generator))  # a ReLU's output: half zeros, many values near 0
    shifted = torch.randn(256, 32, generator=generator) + 3.0  # mostly above zero: the grid is widened to hold it
    kept, nearest = q.QuantSpec(32, bits, keep_positive=True), q.QuantSpec(32, bits)
    for x in (relu, shifted):
        restored = q.dequantize(q.quantize(x, kept), kept, x.dtype)
        assert torch.equal(restored > 0, x > 0) and (restored[x == 0] == 0).all()
        lost = ((q.dequantize(q.quantize(x, nearest), nearest, x.dtype) > 0) != (x > 0)).sum()
        assert lost > 0  # what the option is for: rounding to nearest loses positive values here
    if q.fits_range(bits):
        return  # a fitted grid clamps the largest values: the bounds below are the whole range's
    # A value moved off zero is at most a step away; the others keep rounding to nearest, half a step.
    low, high, *_ = q.channel_stats(relu)
    step = ((high - low) / (2**bits - 1)).expand_as(relu)
    error = (q.dequantize(q.quantize(relu, kept), kept, relu.dtype) - relu).abs()
    assert (error <= step + 1e-6).all()
    assert (error[relu > step] <= step[relu > step] / 2 + 1e-6).all()


def test_keeping_positive_values_is_refused_with_rotated_or_stochastic_codes():
    for options in ({"rotation": 8}, {"stochastic": True}):
        with pytest.raises(ValueError, match="keep_positive reads the values' own signs: not with rotation or "
                                             "stochastic rounding"):
            q.QuantSpec(32, 4, keep_positive=True, **options)


def test_inductor_keeps_positive_values_as_eager_does():
    spec = q.QuantSpec(64, 2, keep_positive=True)
    x = torch.relu(torch.randn(128, 64, generator=torch.Generator().manual_seed(7)))

    def round_trip(t):
        return q.dequantize(q.quantize(t, spec), spec, t.dtype)

    compiled, eager = torch.compile(round_trip)(x), round_trip(x)
    assert torch.equal(compiled > 0, x > 0)
    torch.testing.assert_close(compiled, eager)
