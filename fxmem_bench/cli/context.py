"""`fxmem bench context`: the longest sequence each method trains on (batch 1) under a memory cap."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fxmem.cli.common import (
    add_device,
    add_outputs,
    byte_size,
    config_override,
    console,
    int_at_least,
    print_table,
    write_json,
)
from fxmem.config import PRESETS, overrides_text
from fxmem_bench.choices import CONTEXT_BASELINES, CONTEXT_PRESETS
from fxmem_bench.cli.workloads import get_workload, workload_names

if TYPE_CHECKING:
    from fxmem_bench.context import ContextResult

NAME = "context"
COLUMNS = ("method", "longest fitting", "vs best baseline", "peak incl. static there", "shortest failing",
           "its peak incl. static", "probes", "time per token vs best baseline", "min grad cos", "published bound")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="the longest sequence (batch 1) each method's whole training step "
                                               "fits under a memory cap")
    parser.add_argument("--workload", default="llama-small", choices=workload_names("llama"))
    parser.add_argument("--memory-cap", type=byte_size, required=True, metavar="SIZE",
                        help="weights, optimizer state and the step's peak together, e.g. 2GiB")
    parser.add_argument("--presets", nargs="*", choices=list(PRESETS), default=list(CONTEXT_PRESETS),
                        help="fxmem presets, each with return_logits=False (its loss chunked)")
    parser.add_argument("--baselines", nargs="*", choices=list(CONTEXT_BASELINES),
                        help="default: every one that runs on the device (CUDA only: compile-checkpointing-liger "
                             "where liger-kernel is installed, compile-checkpointing-offload)")
    parser.add_argument("--start", type=int_at_least(1), default=512, help="the first length each search measures")
    parser.add_argument("--granularity", type=int_at_least(1), default=128,
                        help="lengths searched are multiples of this")
    parser.add_argument("--max-seq", type=int_at_least(1), default=1 << 20)
    parser.add_argument("--set", action="append", type=config_override, default=[], metavar="NAME=VALUE",
                        help="set a Config field on every preset (a Python literal: --set mlp_chunk=512 --set "
                             "block_checkpoint=True); repeatable")
    parser.add_argument("--rank", type=int_at_least(1), default=16, help="LoRA rank")
    add_device(parser)
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fxmem.measure import format_bytes
    from fxmem_bench.compare import check_runs_here, left_out_by_default
    from fxmem_bench.context import default_baselines, run_context

    workload = get_workload(args.workload)
    if args.baselines is None:  # what ran, as the legend lists it
        args.baselines = list(default_baselines(args.device, workload.family))
        for method, why in left_out_by_default(CONTEXT_BASELINES, args.device, workload.family).items():
            console.print(f"[yellow]{method} left out: {why}[/yellow]")
    try:
        check_runs_here(args.baselines, torch.device(args.device), workload.family)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    if args.start % args.granularity or args.start > args.max_seq:
        console.print(f"[red]--start ({args.start}) must be a multiple of --granularity ({args.granularity}) and at "
                      f"most --max-seq ({args.max_seq})[/red]")
        return 2
    if not args.presets and not args.baselines:
        console.print("[red]nothing to measure: give at least one preset or baseline[/red]")
        return 2
    with console.status("context") as status:
        results = run_context(workload, args.memory_cap, presets=args.presets, baselines=args.baselines,
                              device=args.device, lora_rank=args.rank, start=args.start,
                              granularity=args.granularity, max_seq=args.max_seq, options=dict(args.set),
                              progress=lambda message: status.update(message))
    print_table(f"fxmem bench context: {workload.name}, batch 1, under {format_bytes(args.memory_cap)}", COLUMNS,
                rows(results), legend(args), args, args.device)
    write_json(results, args, args.device, memory_cap=args.memory_cap, granularity=args.granularity)
    return 0


def rows(results: list[ContextResult]) -> list[list[str]]:
    from fxmem.measure import format_bytes

    baselines = [r for r in results if not r.method.startswith("fxmem")]
    best = max(baselines, key=lambda r: r.longest, default=None)
    table = []
    for r in results:
        here = r.at_longest
        failing = next((p for p in r.probes if p.seq == r.shortest_failing), None)
        versus = (f"{r.longest / best.longest:.2f}x" if best is not None and best.longest and r.longest
                  else "—")
        per_token = (f"{r.seconds_per_token / best.seconds_per_token:.2f}x" if best is not None
                     and best.seconds_per_token and r.seconds_per_token else "—")
        longest = f"{r.longest:,}" + ("" if r.converged else " (search stopped)")
        table.append([r.method, longest, versus, format_bytes(here.total_bytes) if here else "—",
                      f"{failing.seq:,}" if failing else "—", format_bytes(failing.total_bytes) if failing else "—",
                      str(len(r.probes)), per_token,
                      f"{r.fidelity.min_cosine:.6f}" if r.fidelity else "—",
                      f"{r.fidelity_bound}" if r.fidelity_bound is not None else "—"])
    return table


def legend(args: argparse.Namespace) -> str:
    from fxmem_bench.context import BASELINE_DESCRIPTIONS

    return (f"Batch 1; lengths are multiples of {args.granularity}, searched from {args.start}. longest fitting: "
            "the longest length whose whole step fits the cap: the bytes that live across steps (weights, buffers, "
            "AdamW state) plus the step's peak above them (activations, gradients, transients), each measured at "
            "that length by a real step (on a GPU, a length that runs out of memory does not fit). shortest failing: "
            "the shortest length found not to fit (the answer lies between the two; \"search stopped\": the search "
            "ended with them further apart). time per token: one step at the method's longest length over its "
            "tokens, as a ratio to the best baseline's at its own longest length (attention's share grows with the "
            "length, so a longer run costs more per token). min grad cos: fxmem's gradients of the first step against "
            "eager PEFT's at the same length, weights and batch.\n"
            + "".join(f"\n- {m}: {BASELINE_DESCRIPTIONS[m]}" for m in args.baselines)
            + ("\n- fxmem P: torch.compile(backend=fxmem) with preset P and return_logits=False (the loss chunked)"
               + overrides_text(args.set) if args.presets else ""))
