"""Low-rank factors of a saved activation: LoRAct's sampling-based orthogonal decomposition and a randomized SVD.

A matrix A (m x n) is held as two thin factors, U (m x k) and V (k x n), and
rebuilt in backward as U @ V: (m + n) k values instead of m n.

Sampling-based orthogonal decomposition (LoRAct, Algorithm 1). Sample k
distinct rows of A uniformly, A_k (k x n), and use A_k^T as the test matrix:
Y = A A_k^T (m x k) lies in A's column space and, since A's rows are what that
space is made of, concentrates on its dominant part without drawing a Gaussian
matrix. t power iterations (Q = orth(Y), Y = A (A^T Q)) sharpen it. Then U = Q
and V = Q^T A, so U V = Q Q^T A, the orthogonal projection of A onto range(Y):
never larger than A, and exactly A when rank(A) <= k and the sampled rows span
A's row space.

Randomized SVD (Halko, Martinsson and Tropp 2011, the alternative): the same
with a Gaussian test matrix of k + p columns (p oversampling columns), then
the SVD of the small B = Q^T A truncated to rank k: U = Q U_B[:, :k],
V = S_k V_B^T[:k]. It costs the Gaussian draw, the wider sketch and that SVD.

Shorter side, as the paper's code does (shijxcs/meft, linalg/qb.py): when
m > n the decomposition runs on A^T and the factors are transposed back, so
the basis is always of a min(m, n) x k matrix; U V is the same product either way.

Leading dimensions are batch dimensions: A (*, m, n) gives U (*, m, k) and
V (*, k, n), one decomposition per matrix (the same sampled rows for all).
To decompose a (batch, seq, hidden) activation as one (batch * seq) x hidden
matrix, as the paper's code does, flatten it first.

Numerics: the three O(m n k) products run in A's dtype (the work that matters
on a GPU stays in bf16/fp16 on tensor cores, accumulated in fp32); the basis is
found in fp32 by shifted CholeskyQR3 (``_orthonormal_basis``: products, a k x k
Cholesky factorization and a triangular solve, no host synchronization, where
Householder QR synchronizes on CUDA and runs tall matrices slowly), and the
small SVD of the randomized SVD runs in fp32. Each test matrix's
columns are scaled to unit length before multiplying by A: only range(Y)
matters, and unit columns keep |Y| <= ||A||_2, where A A_k^T grows like
n max|a|^2 and overflows fp16 (the paper's code divides by sqrt(n) instead).
Non-finite entries are zeroed before the basis and the SVD (the paper's code
zeroes NaNs), so a NaN or inf activation never makes LAPACK raise; the step's
loss is non-finite anyway, and the sampling factors still carry it into backward.

Reconstruction is U @ V, a plain matmul: cuBLAS (eagerly) or inductor's
matmul lowering (in a compiled backward) already run it at GEMM speed, and
with k much smaller than m and n it is a small share of backward. There is no
Triton kernel here because none would pay: the three products are GEMMs, the
basis is products and a k x k factorization, and the only elementwise work (column scaling, casts) is
O((m + n) k). The pre-norm rebuild needs no fused epilogue either: a
per-column scale folds into the thin factor, (U @ V) / gamma = U @ (V / gamma),
O(k n) work instead of a pass over the m x n result.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fxmem.choices import check_lowrank

# Halko et al. recommend 5 to 10 extra sketch columns; they are paid in compute, not in stored bytes.
RSVD_OVERSAMPLE = 8
# The paper's training script uses one power iteration (shijxcs/meft trainer.py, niter=1).
DEFAULT_NITER = 1


def resolve_rank(rank: float | int, shape: torch.Size | tuple[int, ...]) -> int:  # noqa: PYI041 (int: rank, float: ratio)
    """The rank k of the factors of a tensor of ``shape`` (*, m, n): ``rank`` as a ratio in (0, 1) of n
    (rounded down, at least 1) or an integer >= 1, at most min(m, n)."""
    check_lowrank(rank, allow_none=False)
    if len(shape) < 2:
        raise ValueError(f"a low-rank decomposition needs a tensor of at least 2 dimensions; got shape {tuple(shape)}")
    m, n = shape[-2], shape[-1]
    k = max(1, math.floor(rank * n)) if isinstance(rank, float) else rank
    return min(k, m, n)


def factor_numel(shape: torch.Size | tuple[int, ...], k: int) -> int:
    """Values in U and V together for a tensor of ``shape`` (*, m, n) at rank k."""
    batch = math.prod(shape[:-2])
    return batch * (shape[-2] + shape[-1]) * k


def _finite_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32 with NaN and inf zeroed: LAPACK's SVD raises on them, and a Cholesky factor would carry them."""
    return torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0)


# Shifted CholeskyQR3 (Fukaya, Kannan, Nakatsukasa, Zhang, Kawashima, 2020): each pass orthonormalizes Y as
# Y R^-1, R the Cholesky factor of Y^T Y + shift I. The first, shifted by 1e-5 of Y's squared Frobenius norm, is
# safe however ill-conditioned Y is (a sketch of an activation is nearly rank-deficient): directions weaker than the
# shift come out shrunk instead of blowing up, and carry less than it of A's energy. The next passes make the rest
# orthonormal to fp32's precision. Measured against Householder QR on low-rank-plus-noise matrices up to 2048 x
# 2048 at rank 256, fp32 and bf16: the same reconstruction error to 3 digits.
CHOLESKY_QR_SHIFTS = (1e-5, 1e-7, 1e-10)


def _orthonormal_basis(y: torch.Tensor) -> torch.Tensor:
    """Q (fp32) with orthonormal columns spanning ``y``'s strong directions (CHOLESKY_QR_SHIFTS): matrix products,
    a k x k Cholesky factorization and a triangular solve. ``cholesky_ex`` reports a failure in a tensor instead of
    raising, so nothing waits for the GPU (linalg.qr, and linalg.cholesky's check, synchronize with the host on
    CUDA, and cuSOLVER's QR of a tall matrix is slow); a failed pass keeps the previous pass's Q."""
    y = _finite_fp32(y)
    eye = torch.eye(y.shape[-1], device=y.device, dtype=torch.float32)
    for shift in CHOLESKY_QR_SHIFTS:
        gram = y.mT @ y
        size = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)[..., None, None]
        r, info = torch.linalg.cholesky_ex(gram + (size * shift + torch.finfo(torch.float32).tiny) * eye, upper=True)
        y = torch.where((info == 0)[..., None, None], torch.linalg.solve_triangular(r, y, upper=True, left=False), y)
    return y


def _unit_columns(omega: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    omega = omega.float()
    norm = torch.linalg.vector_norm(omega, dim=-2, keepdim=True)
    # A zero column (a zero row of A sampled) would give a zero column of Y, which CholeskyQR keeps zero: the basis
    # would be a direction short. A Gaussian column in its place samples the range like any other.
    omega = torch.where(norm > 0, omega, torch.randn_like(omega))
    norm = torch.linalg.vector_norm(omega, dim=-2, keepdim=True)
    return (omega / norm.clamp_min(torch.finfo(torch.float32).tiny)).to(dtype)


def _range_basis(a: torch.Tensor, omega: torch.Tensor, niter: int) -> torch.Tensor:
    """Orthonormal basis (fp32, *, m, l) of range(A Ω) after ``niter`` power iterations."""
    y = a @ _unit_columns(omega, a.dtype)
    for _ in range(niter):
        q = _orthonormal_basis(y)
        y = a @ _unit_columns(a.mT @ q.to(a.dtype), a.dtype)
    return _orthonormal_basis(y)


def _on_shorter_side(decompose_rows: Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]],
                     a: torch.Tensor, k: int, niter: int) -> tuple[torch.Tensor, torch.Tensor]:
    if a.shape[-2] <= a.shape[-1]:
        return decompose_rows(a, k, niter)
    u_t, v_t = decompose_rows(a.mT, k, niter)  # A^T = U' V'  =>  A = V'^T U'^T
    return v_t.mT.contiguous(), u_t.mT.contiguous()


def _sampled_rows(a: torch.Tensor, k: int, niter: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randperm(a.shape[-2], device=a.device)[:k]
    q = _range_basis(a, a[..., rows, :].mT, niter)
    u = q.to(a.dtype)
    return u, u.mT @ a


def _gaussian_svd(a: torch.Tensor, k: int, niter: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = min(k + RSVD_OVERSAMPLE, a.shape[-2], a.shape[-1])
    omega = torch.randn(*a.shape[:-2], a.shape[-1], width, device=a.device, dtype=torch.float32)
    q = _range_basis(a, omega, niter)
    b = q.to(a.dtype).mT @ a
    u_b, s, v_b = torch.linalg.svd(_finite_fp32(b), full_matrices=False)
    return (q @ u_b[..., :k]).to(a.dtype), (s[..., :k, None] * v_b[..., :k, :]).to(a.dtype)


def sampled_orthogonal(a: torch.Tensor, k: int, niter: int = DEFAULT_NITER) -> tuple[torch.Tensor, torch.Tensor]:
    """LoRAct's Algorithm 1: (U, V) with A ~= U @ V, rank ``k`` (1 <= k <= min(m, n)), ``niter`` power iterations."""
    _check_factor_rank(a, k, niter)
    return _on_shorter_side(_sampled_rows, a, k, niter)


def randomized_svd(a: torch.Tensor, k: int, niter: int = DEFAULT_NITER) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomized SVD with ``RSVD_OVERSAMPLE`` extra columns, truncated to rank ``k``: (U, V) with A ~= U @ V."""
    _check_factor_rank(a, k, niter)
    return _on_shorter_side(_gaussian_svd, a, k, niter)


METHODS: dict[str, Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]]] = {
    "sampling": sampled_orthogonal,
    "rsvd": randomized_svd,
}


def _check_factor_rank(a: torch.Tensor, k: int, niter: int) -> None:
    if a.dim() < 2 or not a.dtype.is_floating_point:
        raise ValueError(f"a low-rank decomposition needs a floating tensor of at least 2 dimensions; "
                         f"got {a.dtype} of shape {tuple(a.shape)}")
    shorter = min(a.shape[-2], a.shape[-1])
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= shorter:
        raise ValueError(f"rank must be an integer in [1, {shorter}] (the shorter side of {tuple(a.shape[-2:])}); "
                         f"got {k!r}")
    if isinstance(niter, bool) or not isinstance(niter, int) or niter < 0:
        raise ValueError(f"niter (power iterations) must be an integer >= 0; got {niter!r}")


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}; got {method!r}")


# Kept out of what inductor captures in CUDA graphs (mode="reduce-overhead"): "rsvd"'s linalg.svd checks its
# result on the host, and both methods draw random numbers inside the op; neither was verified under capture.
@torch.library.custom_op("fxmem::lowrank_decompose", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def lowrank_decompose(x: torch.Tensor, rank: int, niter: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V), ``x``'s dtype, with x ~= U @ V: U (*, m, rank), V (*, rank, n); ``rank`` is the resolved integer
    (see ``resolve_rank``) and ``method`` one of ``METHODS``. Random: each call samples afresh.

    A ``rank`` above min(m, n) is allowed here (not in the methods): the factors are computed at min(m, n),
    which holds x whole, and padded with zeros to ``rank``. A compiled graph fixes ``rank`` from the hidden
    size while the row count m may be symbolic and, at run time, smaller.
    """
    _check_method(method)
    shorter = min(x.shape[-2], x.shape[-1]) if x.dim() >= 2 else rank
    u, v = METHODS[method](x, min(rank, shorter) if shorter >= 1 else rank, niter)
    if u.shape[-1] < rank:
        u = torch.nn.functional.pad(u, (0, rank - u.shape[-1]))
        v = torch.nn.functional.pad(v, (0, 0, 0, rank - v.shape[-2]))
    return u, v


@lowrank_decompose.register_fake
def _(x, rank, niter, method):
    _check_method(method)
    return x.new_empty((*x.shape[:-1], rank)), x.new_empty((*x.shape[:-2], rank, x.shape[-1]))


@torch.library.custom_op("fxmem::lowrank_decompose_rows", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
def lowrank_decompose_rows(x: torch.Tensor, rank: int, niter: int, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``lowrank_decompose`` of ``x`` viewed as one (rows, n) matrix, rows = all leading dimensions, as the paper's
    code flattens (batch, seq, hidden): U (*x.shape[:-1], rank), V (rank, n). The op does the flattening so a
    compiled graph needs no (possibly symbolic) sizes to undo it."""
    u, v = lowrank_decompose(x.reshape(-1, x.shape[-1]), rank, niter, method)
    # contiguous, as the fake says: the triangular solve's basis (U on a wide matrix) can come out column-major
    return u.contiguous().reshape(*x.shape[:-1], rank), v.contiguous()


@lowrank_decompose_rows.register_fake
def _(x, rank, niter, method):
    _check_method(method)
    return x.new_empty((*x.shape[:-1], rank)), x.new_empty((rank, x.shape[-1]))


@torch.library.custom_op("fxmem::lowrank_rebuild_rows", mutates_args=())
def lowrank_rebuild_rows(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """U @ V for the factors of ``lowrank_decompose_rows``: (*u.shape[:-1], n), contiguous."""
    return (u.reshape(-1, u.shape[-1]) @ v).reshape(*u.shape[:-1], v.shape[-1])


@lowrank_rebuild_rows.register_fake
def _(u, v):
    return u.new_empty((*u.shape[:-1], v.shape[-1]))


def decompose(x: torch.Tensor, rank: float | int, *, method: str = "sampling",  # noqa: PYI041 (int: rank, float: ratio)
              niter: int = DEFAULT_NITER) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, V) of ``x`` (*, m, n) at ``rank``: a ratio in (0, 1) of n or an integer (clamped to min(m, n))."""
    return lowrank_decompose(x, resolve_rank(rank, x.shape), niter, method)


def reconstruct(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """U @ V: the (*, m, n) tensor the factors approximate (a plain matmul; see the module docstring)."""
    return u @ v
