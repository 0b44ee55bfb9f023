"""`fxmem bench gpu-check`: the GPU step table at Llama-3-8B's layer shape in one command (fxmem_bench/gpu_check.py)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fxmem.cli.common import add_device, add_outputs, console, int_at_least, print_table, show_table, write_json
from fxmem_bench.choices import POINT_KEYS, POINTS
from fxmem_bench.cli.compare import bound_cell
from fxmem_bench.cli.workloads import get_workload, workload_names

if TYPE_CHECKING:
    from fxmem_bench.gpu_check import GpuCheck

NAME = "gpu-check"
COLUMNS = ("point", "step vs torch.compile", "step peak", "saved activations", "min LoRA-grad cos vs eager",
           "published bound", "compile s")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="the GPU step table (every baseline and fxmem point, gradient "
                                               "fidelity, a short profile) at Llama-3-8B's layer shape")
    parser.add_argument("--workload", default="llama3-8b-shape", choices=workload_names("llama"))
    parser.add_argument("--points", nargs="+", choices=POINT_KEYS, default=list(POINT_KEYS), metavar="POINT",
                        help=f"the points to run (eager among them), default all: {', '.join(POINT_KEYS)}")
    parser.add_argument("--steps", type=int_at_least(3), default=3, help="interleaved timed rounds")
    parser.add_argument("--top", type=int_at_least(1), default=10, help="kernels listed per profiled point")
    add_device(parser)
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem.timing import round_ratio
    from fxmem_bench.gpu_check import run_gpu_check

    try:
        check = run_gpu_check(get_workload(args.workload), device=args.device, keys=args.points, steps=args.steps,
                              top=args.top, progress=console.print)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    labels = {p.key: p.label for p in POINTS}
    by_key = dict(zip(check.keys, check.results, strict=True))
    compiled = by_key.get("compile")
    rows = [[labels[key], str(round_ratio(r.step_samples, compiled.step_samples)) if compiled else "—",
             format_bytes(r.peak_bytes), format_bytes(r.saved_bytes),
             f"{r.fidelity.min_cosine:.4f}" if r.fidelity else "(reference)", bound_cell(r),
             f"{r.compile_seconds:.0f}" if r.compile_seconds else "—"] for key, r in by_key.items()]
    legend = (f"{args.workload} on {args.device}, every point built from the same weights in one process; step: "
              f"median of {args.steps} interleaved training steps (optimizer included) over torch.compile's, with "
              "the rounds' range; step peak: above the weights and optimizer state; min LoRA-grad cos: the worst "
              "trainable gradient's cosine against eager's on the first batch.\n"
              + "\n".join(_targets(check) + [f"- {labels[key]} did not run: {error}"
                                              for key, error in check.failures.items()]))
    print_table(f"fxmem bench gpu-check: {args.workload}", COLUMNS, rows, legend, args, args.device)
    for profiled in check.profiles:
        show_table(f"profile: {labels[profiled.key]}", ("kernel or op", "time", "calls"),
                   [[name[:90], f"{seconds * 1000:.2f} ms", str(calls)] for name, seconds, calls in profiled.top],
                   f"{profiled.launches} kernels launched by one training step")
    write_json([check], args, args.device)
    return 1 if check.failures else 0


def _targets(check: GpuCheck) -> list[str]:
    """Each step target of the issue, met or missed, where its point ran."""
    from fxmem_bench.gpu_check import STEP_TARGETS

    lines = []
    for key, most in STEP_TARGETS:
        ratio = check.step_ratio(key)
        if ratio is not None:
            verdict = "met" if ratio <= most else "missed"
            lines.append(f"- {key}: {ratio:.2f}x torch.compile's step, target at most {most:.2f}x: {verdict}")
    return lines
