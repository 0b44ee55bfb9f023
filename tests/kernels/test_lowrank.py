"""fxmem::lowrank_decompose: LoRAct's sampling-based decomposition and the randomized SVD, against exact answers."""

import pytest
import torch

from fxmem.cost_model.memory import lowrank_bytes
from fxmem.kernels import lowrank

METHODS = list(lowrank.METHODS)
# (*batch, m, n): wide, tall (decomposed through A^T), and batched
SHAPES = [(48, 160), (160, 48), (2, 3, 40, 30)]


def _rank_k(shape: tuple[int, ...], k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape[:-1], k, generator=g) @ torch.randn(*shape[:-2], k, shape[-1], generator=g)


def low_rank_plus_noise(m: int, n: int, k: int, noise: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # decaying signal spectrum, as activations have (LoRAct figure 2a), under Gaussian noise
    signal = torch.randn(m, k, generator=g) * torch.logspace(1, 0, k) @ torch.randn(k, n, generator=g)
    return signal + noise * torch.randn(m, n, generator=g)


def _relative_error(a: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> float:
    return ((lowrank.reconstruct(u, v).double() - a.double()).norm() / a.double().norm()).item()


def _optimal_error(a: torch.Tensor, k: int) -> float:
    """Eckart-Young: the truncated SVD's relative Frobenius error at rank k, the least any rank-k factors reach."""
    s = torch.linalg.svdvals(a.double())
    return (s[k:].norm() / s.norm()).item()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("niter", [0, 1])
@pytest.mark.parametrize("shape", SHAPES)
def test_an_exactly_rank_k_matrix_comes_back_exactly(method, niter, shape):
    torch.manual_seed(0)
    a = _rank_k(shape, 6)
    u, v = lowrank.decompose(a, 6, method=method, niter=niter)
    assert u.shape == (*shape[:-1], 6) and v.shape == (*shape[:-2], 6, shape[-1])
    assert u.dtype == v.dtype == a.dtype
    assert _relative_error(a, u, v) < 1e-5


def test_zero_rows_sampled_do_not_leave_the_basis_short():
    """Sampling rows of A as the test matrix: a zero row gives a zero sketch column, which is drawn again."""
    torch.manual_seed(0)
    a = _rank_k((48, 160), 6)
    a[10:] = 0  # 38 of 48 rows zero (padding tokens): most samples of 6 rows hit one
    for seed in range(5):
        torch.manual_seed(seed)
        u, v = lowrank.decompose(a, 6, method="sampling", niter=0)
        assert _relative_error(a, u, v) < 1e-5


@pytest.mark.parametrize("shape", [(48, 160), (160, 48)])
def test_sampling_factors_are_an_orthogonal_projection_of_a(shape):
    """U V = Q Q^T A with orthonormal Q on the shorter side: the residual is orthogonal to the reconstruction."""
    torch.manual_seed(1)
    a = low_rank_plus_noise(*shape, 12, 0.3, seed=1)
    u, v = lowrank.decompose(a, 8, method="sampling")
    basis = u if shape[0] <= shape[1] else v.mT
    torch.testing.assert_close(basis.mT @ basis, torch.eye(8), atol=1e-5, rtol=0)
    rebuilt = lowrank.reconstruct(u, v)
    assert abs((rebuilt * (a - rebuilt)).sum().item()) < 1e-3 * a.norm().item() ** 2
    assert rebuilt.norm() <= a.norm()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", [(256, 96), (96, 256)])
def test_error_with_one_power_iteration_is_within_5_percent_of_truncated_svd(method, shape):
    for seed in range(4):
        torch.manual_seed(seed)
        a = low_rank_plus_noise(*shape, 16, 0.5, seed)
        optimal = _optimal_error(a, 16)
        error = _relative_error(a, *lowrank.decompose(a, 16, method=method, niter=1))
        assert optimal * (1 - 1e-4) <= error <= 1.05 * optimal, (seed, error, optimal)


@pytest.mark.parametrize("method", METHODS)
def test_power_iterations_do_not_make_the_error_worse_on_average(method):
    errors = {0: 0.0, 2: 0.0}
    for seed in range(6):
        a = low_rank_plus_noise(200, 120, 10, 1.0, seed)
        for niter in errors:
            torch.manual_seed(seed)
            errors[niter] += _relative_error(a, *lowrank.decompose(a, 10, method=method, niter=niter))
    assert errors[2] <= errors[0]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype, tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3)])
def test_half_inputs_give_half_factors_and_the_basis_is_found_in_fp32_without_qr(method, dtype, tolerance,
                                                                                   monkeypatch):
    factored = []
    cholesky_ex = torch.linalg.cholesky_ex

    def recording_cholesky(gram, *args, **kwargs):
        factored.append(gram.dtype)
        return cholesky_ex(gram, *args, **kwargs)

    def no_qr(*args, **kwargs):
        raise AssertionError("linalg.qr synchronizes with the host on CUDA")

    monkeypatch.setattr(torch.linalg, "cholesky_ex", recording_cholesky)
    monkeypatch.setattr(torch.linalg, "qr", no_qr)
    torch.manual_seed(0)
    a = _rank_k((40, 96), 4).to(dtype)
    u, v = lowrank.decompose(a, 4, method=method, niter=1)
    assert u.dtype == v.dtype == dtype
    # one basis per power iteration and one final, each CholeskyQR3's three passes
    assert factored == [torch.float32] * 2 * len(lowrank.CHOLESKY_QR_SHIFTS)
    assert _relative_error(a, u, v) < tolerance


def test_an_ill_conditioned_sketch_gives_the_reconstruction_householder_qr_gives(monkeypatch):
    """A sketch of a low-rank-plus-small-noise matrix is nearly rank-deficient (its Gram matrix is not positive
    definite in fp32): the shifted first pass must still give a basis as good as QR's."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(384, 40, generator=g) * torch.logspace(2, 0, 40) @ torch.randn(40, 512, generator=g)
    a = a + 0.01 * torch.randn(384, 512, generator=g)
    sketch = a @ a[:64].mT
    assert torch.linalg.cholesky_ex(sketch.mT @ sketch)[1] > 0  # plain CholeskyQR fails here
    errors = []
    for basis in (lowrank._orthonormal_basis, lambda y: torch.linalg.qr(y.float())[0]):
        monkeypatch.setattr(lowrank, "_orthonormal_basis", basis)
        torch.manual_seed(0)
        u, v = lowrank.decompose(a, 64)
        assert torch.isfinite(u).all() and torch.isfinite(v).all()
        errors.append(_relative_error(a, u, v))
    assert errors[0] <= 1.01 * errors[1] + 1e-6, errors


@pytest.mark.parametrize("method", METHODS)
def test_fp16_activations_whose_gram_product_overflows_stay_finite(method):
    torch.manual_seed(0)
    a = (_rank_k((64, 256), 4) * 40).half()
    assert torch.isinf(a @ a[:4].mT).any()  # the unscaled sketch A A_k^T would overflow fp16
    u, v = lowrank.decompose(a, 4, method=method, niter=1)
    assert torch.isfinite(u).all() and torch.isfinite(v).all()
    assert _relative_error(a, u, v) < 4e-3


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("fill", [0.0, 3.0])
@pytest.mark.parametrize("shape", [(16, 40), (40, 16), (2, 8, 8)])
def test_zero_and_constant_matrices_come_back_without_nan(method, fill, shape):
    a = torch.full(shape, fill)
    u, v = lowrank.decompose(a, 4, method=method)
    assert torch.isfinite(u).all() and torch.isfinite(v).all()
    torch.testing.assert_close(lowrank.reconstruct(u, v), a, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_activation_does_not_break_the_qr(method, bad):
    a = _rank_k((32, 48), 3)
    a[5, 7] = bad
    u, v = lowrank.decompose(a, 3, method=method)  # LAPACK refuses a non-finite QR input; the sketch is cleaned
    assert u.shape == (32, 3) and v.shape == (3, 48)


@pytest.mark.parametrize("rank, shape, expected", [
    (0.125, (512, 256), 32),  # a ratio of the last dimension, rounded down
    (0.125, (4, 7, 256), 7),  # ... at most the shorter side
    (0.001, (64, 256), 1),  # ... at least 1
    (24, (64, 256), 24),  # an integer rank
    (500, (64, 256), 64),  # ... clamped to min(m, n)
])
def test_rank_is_a_ratio_of_the_last_dimension_or_an_integer(rank, shape, expected):
    assert lowrank.resolve_rank(rank, shape) == expected


@pytest.mark.parametrize("rank", [1.0, 0.0, 0, -3, True, None, "8"])
def test_bad_ranks_are_refused_naming_the_valid_choices(rank):
    with pytest.raises(ValueError, match=r"a ratio in \(0, 1\) of the last dimension, an integer rank >= 1; got"):
        lowrank.decompose(torch.ones(8, 8), rank)


def test_bad_methods_factor_ranks_iterations_and_inputs_are_refused():
    a = torch.ones(8, 12)
    with pytest.raises(ValueError, match="method must be one of 'sampling', 'rsvd'; got 'svd'"):
        lowrank.decompose(a, 2, method="svd")
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 8\]"):
        lowrank.sampled_orthogonal(a, 9)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[1, 8\]"):
        lowrank.randomized_svd(a, 0)
    with pytest.raises(ValueError, match="niter .* must be an integer >= 0; got -1"):
        lowrank.decompose(a, 2, niter=-1)
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        lowrank.decompose(torch.ones(8), 2)
    with pytest.raises(ValueError, match="floating tensor"):
        lowrank.decompose(torch.ones(8, 8, dtype=torch.int64), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, rank", [((1024, 256), 0.125), ((256, 1024), 0.125), ((3, 50, 20), 4)])
def test_cost_model_bytes_are_the_factors_bytes(dtype, shape, rank):
    a = torch.randn(shape).to(dtype)
    k = lowrank.resolve_rank(rank, shape)
    u, v = lowrank.decompose(a, rank)
    assert lowrank_bytes(shape, k, a.element_size()) == u.nbytes + v.nbytes
    assert u.untyped_storage().nbytes() + v.untyped_storage().nbytes() == u.nbytes + v.nbytes  # no hidden storage
    if shape == (1024, 256):  # a tall activation at ratio 1/8 keeps (m + n) / (8 m) of its bytes
        assert lowrank_bytes(shape, k, a.element_size()) == (1024 + 256) * 32 * a.element_size()


def test_the_custom_op_passes_opcheck_and_traces_with_fake_tensors():
    a = _rank_k((2, 24, 16), 3)
    # Not test_aot_dispatch_*: they compare two calls' outputs, and each call samples afresh.
    torch.library.opcheck(torch.ops.fxmem.lowrank_decompose.default, (a, 3, 1, "sampling"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    torch.library.opcheck(torch.ops.fxmem.lowrank_decompose.default, (a, 3, 1, "rsvd"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))

    def compress_and_rebuild(x):
        return lowrank.reconstruct(*torch.ops.fxmem.lowrank_decompose(x, 3, 1, "sampling"))

    compiled = torch.compile(compress_and_rebuild, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(a), a, atol=1e-4, rtol=1e-4)


def test_the_row_ops_flatten_leading_dimensions_and_pass_opcheck():
    a = torch.randn(2, 12, 3) @ torch.randn(3, 16)  # one 24 x 16 matrix of rank 3: one right factor for both
    u, v = torch.ops.fxmem.lowrank_decompose_rows(a, 4, 1, "sampling")
    assert u.shape == (2, 12, 4) and v.shape == (4, 16) and u.is_contiguous() and v.is_contiguous()
    torch.testing.assert_close(torch.ops.fxmem.lowrank_rebuild_rows(u, v), a, atol=1e-4, rtol=1e-4)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.fxmem.lowrank_decompose_rows.default, (a, 4, 1, "rsvd"), test_utils=checks)
    torch.library.opcheck(torch.ops.fxmem.lowrank_rebuild_rows.default, (u, v))
    wide_u, wide_v = torch.ops.fxmem.lowrank_decompose_rows(a[:, :4], 4, 1, "sampling")  # 8 x 16: Q from LAPACK
    assert wide_u.is_contiguous() and wide_v.is_contiguous()


@pytest.mark.parametrize("method", METHODS)
def test_a_rank_above_the_row_count_pads_the_factors_with_zeros(method):
    """A compiled graph fixes the rank from the hidden size; a short batch can have fewer rows than that."""
    a = torch.randn(5, 32)
    u, v = torch.ops.fxmem.lowrank_decompose(a, 8, 1, method)
    assert u.shape == (5, 8) and v.shape == (8, 32)
    assert not u[:, 5:].any() and not v[5:].any()
    torch.testing.assert_close(lowrank.reconstruct(u, v), a, atol=1e-5, rtol=1e-5)  # rank 5 holds all 5 rows
