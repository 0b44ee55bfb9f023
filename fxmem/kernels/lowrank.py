"""Low-rank factors of a saved activation: LoRAct's sampling-based orthogonal decomposition and a randomized SVD.

A matrix A (m x n) is held as two thin factors, U (m x k) and V (k x n), and
rebuilt in backward as U @ V: (m + n) k values instead of m n.

Sampling-based orthogonal decomposition (LoRAct, Algorithm 1). Sample k
distinct rows of A uniformly, A_k (k x n), and use A_k^T as the test matrix:
Y = A A_k^T (m x k) lies in A's column space and, since A's rows are what that
space is made of, concentrates on its dominant part without drawing a Gaussian
matrix. t power iterations (Q = qr(Y), Y = A (A^T Q)) sharpen it. Then U = Q
and V = Q^T A, so U V = Q Q^T A, the orthogonal projection of A onto range(Y):
never larger than A, and exactly A when rank(A) <= k and the sampled rows span
A's row space.

Randomized SVD (Halko, Martinsson and Tropp 2011, the alternative): the same
with a Gaussian test matrix of k + p columns (p oversampling columns), then
the SVD of the small B = Q^T A truncated to rank k: U = Q U_B[:, :k],
V = S_k V_B^T[:k]. It costs the Gaussian draw, the wider sketch and that SVD.

Shorter side, as the paper's code does (shijxcs/meft, linalg/qb.py): when
m > n the decomposition runs on A^T and the factors are transposed back, so
the QR is always of a min(m, n) x k matrix; U V is the same product either way.

Leading dimensions are batch dimensions: A (*, m, n) gives U (*, m, k) and
V (*, k, n), one decomposition per matrix (the same sampled rows for all).
To decompose a (batch, seq, hidden) activation as one (batch * seq) x hidden
matrix, as the paper's code does, flatten it first.

Numerics: the three O(m n k) products run in A's dtype (the work that matters
on a GPU stays in bf16/fp16); QR and the small SVD run in fp32 (CPU has no
half-precision QR, and Q loses orthogonality in half). Each test matrix's
columns are scaled to unit length before multiplying by A: only range(Y)
matters, and unit columns keep |Y| <= ||A||_2, where A A_k^T grows like
n max|a|^2 and overflows fp16 (the paper's code divides by sqrt(n) instead).
Non-finite entries are zeroed before QR and SVD (the paper's code zeroes NaNs),
so a NaN or inf activation never makes LAPACK raise; the step's loss is
non-finite anyway, and the sampling factors still carry it into backward.

Reconstruction is U @ V, a plain matmul: cuBLAS (eagerly) or inductor's
matmul lowering (in a compiled backward) already run it at GEMM speed, and
with k much smaller than m and n it is a small share of backward. There is no
Triton kernel here because none would pay: the three products are GEMMs, the
QR is cuSOLVER's, and the only elementwise work (column scaling, casts) is
O((m + n) k). The pre-norm rebuild needs no fused epilogue either: a
per-column scale folds into the thin factor, (U @ V) / gamma = U @ (V / gamma),
O(k n) work instead of a pass over the m x n result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

# Halko et al. recommend 5 to 10 extra sketch columns; they are paid in compute, not in stored bytes.
RSVD_OVERSAMPLE = 8
# The paper's training script uses one power iteration (shijxcs/meft trainer.py, niter=1).
DEFAULT_NITER = 1


def check_lowrank(value: Any, *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``value`` is a rank ratio in (0, 1), an integer rank >= 1 (or None, if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    if isinstance(value, float) and 0 < value < 1:
        return
    off = ", or None (off)" if allow_none else ""
    raise ValueError(f"lowrank must be a ratio in (0, 1) of the last dimension, an integer rank >= 1{off}; "
                     f"got {value!r}")


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
    """``t`` in fp32 with NaN and inf zeroed: LAPACK's QR and SVD raise on them."""
    return torch.nan_to_num(t.float(), nan=0.0, posinf=0.0, neginf=0.0)


def _orthonormal_basis(y: torch.Tensor) -> torch.Tensor:
    """Q (fp32) with orthonormal columns spanning ``y``'s; Householder QR gives orthonormal Q even for rank-deficient
    or zero ``y``, so Q Q^T A stays a projection."""
    q, _ = torch.linalg.qr(_finite_fp32(y))
    return q


def _unit_columns(omega: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    omega = omega.float()
    norm = torch.linalg.vector_norm(omega, dim=-2, keepdim=True)
    return (omega / norm.clamp_min(torch.finfo(torch.float32).tiny)).to(dtype)  # a zero column stays zero


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


# torch.linalg.qr / svd synchronize with the host on CUDA, which a CUDA graph capture forbids: the tag keeps the
# decompositions out of what inductor captures (mode="reduce-overhead").
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
    # contiguous, as the fake says: LAPACK's Q (U on a wide matrix) is column-major
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
