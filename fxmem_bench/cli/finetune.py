"""`fxmem bench finetune`: a short LoRA fine-tune on real text with and without fxmem, side by side."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_device, add_preset, console, int_at_least, print_table, progress_bars
from fxmem_bench.cli.compare import LEGEND
from fxmem_bench.cli.workloads import add_workload, get_workload

NAME = "finetune"
COLUMNS = ("method", "saved activations", "vs eager", "step peak", "step time", "vs eager", "first step",
           "final loss")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="a short LoRA fine-tune with and without fxmem, side by side")
    add_workload(parser, "llama-tiny")
    parser.add_argument("--steps", type=int_at_least(3), default=40,
                        help="optimizer steps per method (>= 3: the first measures saved bytes, the second peak)")
    parser.add_argument("--lr", type=float, default=1e-3)
    add_preset(parser)
    add_device(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem_bench import finetune as harness

    workload = get_workload(args.workload)
    console.print(f"LoRA fine-tune of {workload.name} ({workload.description}), batch {workload.batch} x "
                  f"{workload.seq} tokens of Python standard-library source, {args.steps} steps, AdamW lr {args.lr}")
    with progress_bars() as progress:
        tasks = {m: progress.add_task(f"fxmem ({args.preset})" if m == "fxmem" else m, total=args.steps, loss="—")
                 for m in harness.FINETUNE_METHODS}
        results = harness.finetune(workload, harness.FINETUNE_METHODS, steps=args.steps, lr=args.lr,
                                   preset=args.preset, device=args.device,
                                   on_step=lambda method, step, loss: progress.update(
                                       tasks[method], completed=step, loss=f"{loss:.4f}"))
    eager = results[0]
    rows = [[f"fxmem ({args.preset})" if r.method == "fxmem" else r.method, format_bytes(r.saved_bytes),
             f"{eager.saved_bytes / r.saved_bytes:.2f}x smaller" if r is not eager else "—",
             format_bytes(r.peak_bytes), f"{r.step_seconds * 1000:.0f} ms",
             f"{r.step_seconds / eager.step_seconds:.2f}x" if r is not eager else "—",
             f"{r.first_step_seconds:.1f} s", f"{r.final_loss:.4f}"] for r in results]
    legend = ("saved activations: bytes held from forward to backward, parameters and inputs excluded. "
              f"step peak: {LEGEND['step peak']}. first step includes compilation (caches off). "
              "final loss: mean of the last 5 steps.")
    print_table(f"{workload.name}: {args.steps} steps", COLUMNS, rows, legend, args, args.device)
    return 0
