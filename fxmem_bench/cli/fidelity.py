"""`fxmem bench fidelity`: each method's gradients against eager in the workload's dtype and against fp32 eager."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fxmem.cli.common import add_device, add_outputs, config_override, console, int_at_least, print_table, write_json
from fxmem.config import PRESETS
from fxmem_bench.choices import FIDELITY_BASELINES, FIDELITY_TOKENS
from fxmem_bench.cli.workloads import get_workload, workload_names

if TYPE_CHECKING:
    from fxmem_bench.fidelity import FidelityResult

NAME = "fidelity"
DEFAULT_METHODS = ("eager", "compile", "exact", "hyclora-4bit", "hyclora-2bit", "loract")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="gradient fidelity of each method in the workload's dtype (bf16 "
                                               "workloads: llama3-bf16-small, llama3-8b-shape) and against fp32")
    parser.add_argument("--workload", default="llama3-bf16-small", choices=workload_names("llama"))
    parser.add_argument("--methods", nargs="+", choices=[*FIDELITY_BASELINES, *PRESETS], default=list(DEFAULT_METHODS))
    parser.add_argument("--steps", type=int_at_least(0), default=0,
                        help="also train each method this many AdamW steps and compare again")
    parser.add_argument("--time", type=int_at_least(0), default=0, metavar="N",
                        help="also time each method: median forward + backward of N steps on the first batch, as "
                             "a ratio to torch.compile's (else to the first method's)")
    parser.add_argument("--no-logits", action="store_true",
                        help="fxmem presets with return_logits=False (the loss chunked; the gradients the same)")
    parser.add_argument("--set", action="append", type=config_override, default=[], metavar="NAME=VALUE",
                        help="override a Config field of every fxmem preset (e.g. --set lora_half_products='on'); "
                             "repeatable")
    parser.add_argument("--tokens", choices=FIDELITY_TOKENS, default="text",
                        help="the batches: the workload's real text, or token ids drawn uniformly from the vocabulary")
    parser.add_argument("--lowering", choices=["inductor", "eager"], default="inductor")
    add_device(parser)
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem_bench.fidelity import measure

    workload = get_workload(args.workload)
    options = {**dict(args.set), **({"return_logits": False} if args.no_logits else {})}
    done: list[FidelityResult] = []

    def show(result: FidelityResult) -> None:  # each result written as it comes: a long GPU run may be cut short
        first = result.comparisons[0]
        console.print(f"{result.method}: min cosine {first.same_dtype.min_cosine:.4f} "
                      f"({first.same_dtype.worst_parameter}), against fp32 {first.fp32.min_cosine:.4f}")
        done.append(result)
        write_json(done, args, args.device, workload=workload.name, steps=args.steps, options=options,
                   tokens=args.tokens)

    try:
        results = measure(workload, args.methods, steps=args.steps, device=args.device, lowering=args.lowering,
                          options=options, timed_steps=args.time, tokens=args.tokens, on_result=show)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    print_table(f"fxmem bench fidelity: {workload.name}", *_table(results, args), args, args.device)
    return 0


def _table(results: list[FidelityResult], args: argparse.Namespace) -> tuple[list[str], list[list[str]], str]:
    from fxmem.fidelity import short_name
    from fxmem.measure import format_bytes
    from fxmem_bench.fidelity import LEARNING_RATE

    columns = ["method", "saved", "min cos", "worst parameter", "median err", "min cos vs fp32"]
    if args.steps:
        columns += [f"min cos, {args.steps} steps", f"vs fp32, {args.steps} steps"]
    # step times as ratios (never absolute CPU seconds): to torch.compile's, else to the first method's
    base = next((r for r in results if r.method == "compile"), results[0]) if args.time and results else None
    if base:
        columns.append(f"step vs {'torch.compile' if base.method == 'compile' else base.method}")
    rows = []
    for r in results:
        first = r.comparisons[0]
        row = [r.method, format_bytes(r.saved_bytes), f"{first.same_dtype.min_cosine:.4f}",
               short_name(first.same_dtype.worst_parameter), f"{first.same_dtype.median_relative_error:.4f}",
               f"{first.fp32.min_cosine:.4f}"]
        if args.steps:
            trained = r.comparisons[-1]
            row += [f"{trained.same_dtype.min_cosine:.4f}", f"{trained.fp32.min_cosine:.4f}"]
        if base:
            row.append(f"{r.step_seconds / base.step_seconds:.2f}x")
        rows.append(row)
    tokens = "real text" if args.tokens == "text" else "random token ids"
    legend = (f"{args.workload} on {tokens}, {args.lowering} lowering"
              f"{', return_logits=False' if args.no_logits else ''}. "
              "min cos: the lowest cosine similarity of any trainable gradient against eager PEFT's in the "
              "workload's dtype on the same batch and weights (median err: the median relative L2 error); vs fp32: "
              "against eager PEFT in fp32 at the same weights (eager's own row is the floor of the dtype). "
              f"After N steps: each method trained N AdamW steps (lr {LEARNING_RATE:g}) on the next batches, then "
              "compared on the first again. saved: bytes autograd holds for backward on the first batch."
              + (" step: median forward + backward on the first batch, in this process, one after another."
                 if args.time else ""))
    return columns, rows, legend
