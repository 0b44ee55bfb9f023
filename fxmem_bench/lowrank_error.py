"""How well each low-rank method rebuilds a matrix at equal rank, and how long it takes (``fxmem bench lowrank-error``).

Methods, all at the same rank k (the stored factors are the same size):
LoRAct's sampling-based decomposition, fxmem's randomized SVD (Gaussian test
matrix, ``RSVD_OVERSAMPLE`` extra columns), ``torch.svd_lowrank`` (q = k, the
same power iterations) and the truncated SVD, the optimum (Eckart-Young).
Matrices: low-rank-plus-noise ones with a decaying spectrum, and the tensors
eager PEFT LoRA saves for backward on a workload (flattened to rows x last
dimension, as the paper's code compresses them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from fxmem.kernels import lowrank
from fxmem.measure import model_tensors
from fxmem_bench.workloads import get_workload

Rebuild = Callable[[torch.Tensor, int], torch.Tensor]

SYNTHETIC_SHAPES = ((1024, 256), (2048, 688), (4096, 1024))
# Signal ranks as ratios of the last dimension: below the default rank ratio 1/8 (rank k holds all the signal)
# and above it (k must choose among signal directions, as with real activations).
SIGNAL_RANK_RATIOS = (1 / 16, 1 / 4)
NOISE = 0.1  # rms of the noise entries; the signal's rms entry is 1
MIN_COLUMNS = 64  # activations narrower than this (attention heads) are left out: rank 1/8 of them is a few


@dataclass(frozen=True)
class ErrorRow:
    matrix: str
    shape: tuple[int, int]
    rank: int
    method: str
    relative_error: float  # ||A - U V||_F / ||A||_F, mean over the repeats (each draws afresh)
    vs_optimal: float  # relative_error / the truncated SVD's
    seconds: float  # median over the repeats of decomposing and rebuilding

    def to_dict(self) -> dict:
        return asdict(self)


def rebuild_methods(niter: int) -> dict[str, Rebuild]:
    """Each method as a function (A, k) -> its rank-k reconstruction."""
    def sampling(a: torch.Tensor, k: int) -> torch.Tensor:
        return lowrank.reconstruct(*lowrank.sampled_orthogonal(a, k, niter))

    def rsvd(a: torch.Tensor, k: int) -> torch.Tensor:
        return lowrank.reconstruct(*lowrank.randomized_svd(a, k, niter))

    def svd_lowrank(a: torch.Tensor, k: int) -> torch.Tensor:
        u, s, v = torch.svd_lowrank(a, q=k, niter=niter)
        return (u * s.unsqueeze(-2)) @ v.mT

    def truncated(a: torch.Tensor, k: int) -> torch.Tensor:
        u, s, vh = torch.linalg.svd(a, full_matrices=False)
        return (u[..., :k] * s[..., None, :k]) @ vh[..., :k, :]

    return {f"sampling (LoRAct), t={niter}": sampling,
            f"rsvd (fxmem, p={lowrank.RSVD_OVERSAMPLE}), t={niter}": rsvd,
            f"torch.svd_lowrank (q=k), t={niter}": svd_lowrank,
            "truncated SVD (optimal)": truncated}


def synthetic_matrices(shapes: Iterable[tuple[int, int]] = SYNTHETIC_SHAPES, seed: int = 0
                       ) -> list[tuple[str, torch.Tensor]]:
    """Low-rank-plus-noise matrices: signals of each rank in ``SIGNAL_RANK_RATIOS`` with singular values decaying
    geometrically from 10 to 1 (as activations' do, LoRAct figure 2a), plus Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    matrices = []
    for m, n in shapes:
        for ratio in SIGNAL_RANK_RATIOS:
            r = max(1, round(n * ratio))
            left, _ = torch.linalg.qr(torch.randn(m, r, generator=g))
            right, _ = torch.linalg.qr(torch.randn(n, r, generator=g))
            singular = torch.logspace(1, 0, r)
            singular *= (m * n) ** 0.5 / singular.norm()  # ||signal||_F^2 = m n: rms entry 1
            signal = (left * singular) @ right.mT
            matrices.append((f"rank {r} signal + noise", signal + NOISE * torch.randn(m, n, generator=g)))
    return matrices


def saved_activations(workload_name: str = "llama-tiny", limit: int = 8) -> list[tuple[str, torch.Tensor]]:
    """The first ``limit`` distinct floating tensors eager PEFT LoRA saves on one batch (seeded random weights, real
    text), as rows x last dimension; named by the order they are saved in and their shape."""
    setup = get_workload(workload_name).build()
    batch = next(setup.batches)
    excluded = {t.untyped_storage().data_ptr() for t in (*model_tensors(setup.model), *batch.values())}
    found: dict[int, tuple[str, torch.Tensor]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        pointer = tensor.untyped_storage().data_ptr()
        if (len(found) < limit and pointer not in excluded and pointer not in found and tensor.dim() >= 2
                and tensor.dtype.is_floating_point and tensor.shape[-1] >= MIN_COLUMNS):
            name = f"{workload_name} saved #{len(found)} {tuple(tensor.shape)}"
            found[pointer] = (name, tensor.detach().reshape(-1, tensor.shape[-1]).float().clone())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        setup.loss(setup.model, batch)
    return list(found.values())


def measure(matrices: Iterable[tuple[str, torch.Tensor]], rank: float | int, *,  # noqa: PYI041 (int: rank)
            niter: int = lowrank.DEFAULT_NITER, repeats: int = 3, seed: int = 0) -> list[ErrorRow]:
    """Error and median time of every method on every matrix at rank ``rank`` (a ratio or an integer)."""
    methods = rebuild_methods(niter)
    rows = []
    for name, a in matrices:
        k = lowrank.resolve_rank(rank, a.shape)
        if k == min(a.shape):
            continue  # rank k holds the whole matrix: nothing to compress, nothing to compare
        results = {}
        for method, rebuild in methods.items():
            torch.manual_seed(seed)
            times, errors = [], []
            for _ in range(repeats):
                start = time.perf_counter()
                rebuilt = rebuild(a, k)
                times.append(time.perf_counter() - start)
                errors.append(((rebuilt - a).norm() / a.norm()).item())
            results[method] = (statistics.mean(errors), statistics.median(times))
        optimal = results["truncated SVD (optimal)"][0]
        rows += [ErrorRow(name, tuple(a.shape), k, method, error, error / optimal if optimal else float("nan"),
                          seconds) for method, (error, seconds) in results.items()]
    return rows
