"""`fxmem bench hift`: HiFT (one layer group trained per step) in each order against plain full fine-tuning."""

from __future__ import annotations

import argparse

from fxmem.choices import HIFT_ORDERS
from fxmem.cli.common import add_device, add_outputs, console, int_at_least, print_table
from fxmem_bench.choices import HIFT_COMPILE_CHOICES, HIFT_SCOPES
from fxmem_bench.cli.compare import LEGEND
from fxmem_bench.cli.workloads import add_workload, get_workload

NAME = "hift"
COLUMNS = ("run", "k", "steps", "eval loss", "vs full, same batches", "vs full, same updates", "gradients mean / max",
           "optimizer state on device mean / max", "offloaded max", "step peak", "step time", "vs full", "graphs",
           "eager fallbacks")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="HiFT (one layer group per step) against plain full fine-tuning")
    add_workload(parser, "minilm-real")
    parser.add_argument("--cycles", type=int_at_least(2), default=20,
                        help="full HiFT cycles (k steps each; plain fine-tuning takes as many steps)")
    parser.add_argument("--orders", nargs="+", choices=list(HIFT_ORDERS), default=list(HIFT_ORDERS))
    parser.add_argument("--layers-per-group", type=int_at_least(1), default=1)
    parser.add_argument("--lr", type=float, default=2e-5, help="AdamW peak LR, cosine decay over the run")
    parser.add_argument("--compile", default="none", choices=list(HIFT_COMPILE_CHOICES),
                        help="torch.compile backend (plain: the whole model; HiFT: see --scope)")
    parser.add_argument("--scope", default="blocks", choices=list(HIFT_SCOPES),
                        help="what HiFT compiles: each block (hift.compile) or the whole model")
    add_device(parser)
    add_outputs(parser, json_results=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem_bench import hift as harness

    workload = get_workload(args.workload)
    console.print(f"full fine-tuning of {workload.name} ({workload.description}), batch {workload.batch} x "
                  f"{workload.seq}, AdamW lr {args.lr} cosine-decayed, {args.cycles} HiFT cycles; "
                  f"compile: {args.compile}" + (f" ({args.scope})" if args.compile != "none" else ""))
    with console.status("training") as status:
        results = harness.compare_hift(workload, args.orders, cycles=args.cycles, lr=args.lr,
                                       layers_per_group=args.layers_per_group, compile_backend=args.compile,
                                       scope=args.scope, device=args.device,
                                       on_step=lambda name, step: status.update(f"{name}: step {step}"))
    same_batches, same_updates, k = results[0], results[1], results[2].groups
    rows = [[r.name, str(r.groups), str(r.steps), f"{r.eval_loss:.4f}",
             f"{(r.eval_loss - same_batches.eval_loss) / same_batches.eval_loss:+.2%}",
             f"{(r.eval_loss - same_updates.eval_loss) / same_updates.eval_loss:+.2%}",
             _mean_max(r.gradient_bytes), _mean_max(r.device_state_bytes),
             format_bytes(max(r.offloaded_state_bytes)), format_bytes(r.step_peak_bytes),
             f"{r.step_seconds * 1000:.0f} ms", f"{r.step_seconds / same_batches.step_seconds:.2f}x", str(r.graphs),
             str(r.eager_fallbacks)] for r in results]
    legend = (f"eval loss: mean over {harness.EVAL_BATCHES} held-out batches after training. full, same batches: "
              f"{args.cycles * k} steps on the batches HiFT saw; full, same updates: {args.cycles} steps, each "
              "parameter updated as often as under HiFT. gradients / optimizer state: what each step holds, from the "
              "live tensors, mean and largest over the steps (on a CPU run 'offloaded' is an accounting category: the "
              f"device is the CPU). step peak: {LEGEND['step peak']}, largest over the last cycle. graphs: dynamo "
              "graphs compiled during the run.")
    print_table(f"{workload.name}: {args.cycles} cycles of k={k} steps", COLUMNS, rows, legend, args, args.device)
    return 0


def _mean_max(values: list[int]) -> str:
    from fxmem.measure import format_bytes
    return f"{format_bytes(sum(values) / len(values))} / {format_bytes(max(values))}"
