"""`fxmem bench profile`: where one step's time goes, and the share compressing and decompressing takes."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, add_preset, console, int_at_least, print_table, write_json
from fxmem_bench.cli.workloads import add_workload, get_workload

NAME = "profile"
COLUMNS = ("op or kernel", "self time", "share", "calls")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="one step's time by op and kernel, and what compression costs of it")
    add_workload(parser, "llama-small")
    add_preset(parser)
    parser.add_argument("--steps", type=int_at_least(1), default=5, help="timed steps of each variant")
    parser.add_argument("--top", type=int_at_least(1), default=15, help="ops and kernels listed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--drop-logits", action="store_true",
                        help="fxmem returns no logits (return_logits=False), so that it chunks the loss")
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.timing import median
    from fxmem_bench.profile import COMPRESSION_PASSES, profile_step

    workload = get_workload(args.workload)
    with console.status("profiling") as status:
        result = profile_step(workload, args.preset, steps=args.steps, top=args.top, device=args.device,
                              return_logits=not args.drop_logits, progress=lambda message: status.update(message))
    rows = [[name, f"{seconds * 1000:.1f} ms", f"{seconds / result.profiled_seconds:.1%}", str(calls)]
            for name, seconds, calls in result.top]
    step, plain = median(result.step_samples), median(result.uncompressed_samples)
    compiled = median(result.compile_samples)
    logits = ", fxmem returning no logits" if args.drop_logits else ""
    legend = (f"{workload.name}, preset {args.preset}{logits}: step {step:.3f} s ({step / compiled:.2f}x "
              f"torch.compile's {compiled:.3f} s), the same without the compression passes "
              f"({', '.join(COMPRESSION_PASSES)}) {plain:.3f} s ({plain / compiled:.2f}x), medians of {args.steps} "
              f"interleaved steps: compressing and decompressing take {result.compression_seconds:.3f} s, "
              f"{result.compression_share:.1%} of the step. "
              f"Kernels launched by a forward and backward: {result.launches} (torch.compile: "
              f"{result.compile_launches}; on the CPU, what a GPU would launch: inductor's kernels and the aten ops "
              f"that run one)."
              "\nop or kernel: the profiler's self CPU time in one "
              "profiled step (inductor's kernels by name: cpp_fused_<ops>); share: of that step's total self time.")
    print_table(f"fxmem bench profile: {workload.name}, {args.preset}", COLUMNS, rows, legend, args, args.device)
    write_json([result], args, args.device)
    return 0
