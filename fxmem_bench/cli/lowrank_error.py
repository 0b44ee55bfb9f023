"""`fxmem bench lowrank-error`: low-rank reconstruction error and time at equal rank, per decomposition."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, console, int_at_least, lowrank_rank, print_table

NAME = "lowrank-error"
COLUMNS = ("matrix", "shape", "rank", "method", "relative error", "vs truncated SVD", "time")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="low-rank reconstruction error and time at equal rank: LoRAct's "
                                               "sampling vs randomized SVD vs truncated SVD")
    parser.add_argument("--rank", type=lowrank_rank, default=0.125,
                        help="a ratio in (0, 1) of the last dimension or an integer rank (default 0.125)")
    parser.add_argument("--niter", type=int_at_least(0), default=1, help="power iterations (default 1)")
    parser.add_argument("--repeats", type=int_at_least(1), default=3, help="draws per method and matrix")
    parser.add_argument("--sources", nargs="+", choices=["synthetic", "llama-tiny"],
                        default=["synthetic", "llama-tiny"],
                        help="low-rank-plus-noise matrices and/or llama-tiny's saved activations")
    add_outputs(parser, json_results=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fxmem_bench.lowrank_error import measure, saved_activations, synthetic_matrices

    matrices = []
    with console.status("building matrices"):
        if "synthetic" in args.sources:
            matrices += synthetic_matrices()
        if "llama-tiny" in args.sources:
            matrices += saved_activations("llama-tiny")
    with console.status("decomposing"):
        results = measure(matrices, args.rank, niter=args.niter, repeats=args.repeats)
    rows = [[r.matrix, "x".join(map(str, r.shape)), str(r.rank), r.method, f"{r.relative_error:.4f}",
             f"{r.vs_optimal:.3f}x", f"{r.seconds * 1000:.1f} ms"] for r in results]
    legend = (f"{torch.get_num_threads()} thread(s). relative error: ||A - UV||_F / ||A||_F, mean of {args.repeats} "
              "draws; time: median of the draws, decomposition plus reconstruction.")
    print_table("fxmem bench lowrank-error", COLUMNS, rows, legend, args)
    return 0
