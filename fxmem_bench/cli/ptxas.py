"""`fxmem bench ptxas`: every Triton kernel built for a GPU target without a GPU, with ptxas's figures."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, console, int_at_least, print_table, write_json

NAME = "ptxas"
COLUMNS = ("kernel", "variant", "registers", "spilled", "stack", "shared", "error")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="build the Triton kernels for a CUDA arch, no GPU: registers, spills")
    parser.add_argument("--arch", type=int_at_least(70), default=90, help="compute capability x10 (default: 90, H100)")
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem_bench.ptxas import compile_kernels

    with console.status(f"building for sm_{args.arch}"):
        builds = compile_kernels(args.arch)
    rows = [[b.kernel, b.variant, str(b.registers), f"{b.spill_bytes} B", f"{b.stack_bytes} B",
             f"{b.shared_bytes} B", (b.error or "").splitlines()[0] if b.error else ""] for b in builds]
    legend = (f"sm_{args.arch}, Triton's own ptxas; registers per thread, spilled = spill stores + loads; the rank "
              "is a run-time argument, so each build covers every rank")
    print_table(f"fxmem bench ptxas (sm_{args.arch})", COLUMNS, rows, legend, args)
    write_json(builds, args, arch=args.arch)
    return 1 if any(b.error for b in builds) else 0
