"""`fxmem bench ablate`: the accuracy side of the lossy presets, each setting trained beside eager and compile."""

from __future__ import annotations

import argparse

from fxmem.choices import BITS_CHOICES
from fxmem.cli.common import (
    add_device,
    add_outputs,
    console,
    int_at_least,
    lowrank_rank,
    print_table,
    progress_bars,
    write_json,
)
from fxmem_bench.cli.workloads import add_workload, get_workload

NAME = "ablate"
COLUMNS = ("setting", "saved activations", "vs eager", "min grad cosine", "median grad error", "final loss",
           "vs compile", "step time vs compile")
EVAL_COLUMNS = ("eval loss", "eval vs compile", "eval accuracy")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(
        NAME, help="accuracy of the lossy presets: HyC-LoRA's bits x intra/inter-operator x outlier channels, "
                   "or LoRAct's rank ratios x pre-norm sharing")
    add_workload(parser, "llama-tiny")
    parser.add_argument("--steps", type=int_at_least(3), default=200)
    parser.add_argument("--technique", choices=["hyclora", "loract"], default="hyclora",
                        help="hyclora: the --bits settings; loract: per --ratios value, the preset at that ratio "
                             "(pre-norm), without pre-norm sharing (layer-wise), and without 8-bit codes "
                             "(q/k/v factored, as the paper)")
    parser.add_argument("--bits", type=int, nargs="+", choices=BITS_CHOICES, help="hyclora: bit widths (default 4 2)")
    parser.add_argument("--ratios", nargs="+", type=lowrank_rank,
                        help="loract: lowrank values, ratios in (0, 1) of the last dimension or integer ranks "
                             "(default 0.5 0.25 0.125 0.0625)")
    parser.add_argument("--settings", nargs="+", metavar="NAME",
                        help="run only these fxmem settings (names as the table prints them), beside the baselines")
    parser.add_argument("--lr", type=float, default=1e-3)
    add_device(parser)
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem_bench import ablation

    workload = get_workload(args.workload)
    misplaced = "--ratios" if args.technique == "hyclora" and args.ratios else \
        "--bits" if args.technique == "loract" and args.bits else None
    if misplaced:
        console.print(f"[red]{misplaced} does not apply to --technique {args.technique}[/red]")
        return 2
    try:
        if args.technique == "hyclora":
            settings = ablation.hyclora_settings(args.bits or ablation.DEFAULT_BITS)
        else:
            settings = ablation.loract_settings(args.ratios or ablation.DEFAULT_RATIOS)
        if args.settings:
            settings = ablation.select_settings(settings, args.settings)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    console.print(f"{workload.name} ({workload.description}): {args.steps} LoRA steps on its real text, "
                  f"AdamW lr {args.lr}, {len(settings)} settings round-robin")
    with progress_bars(20) as progress:
        tasks = {s.name: progress.add_task(s.name, total=args.steps, loss="—") for s in settings}
        results = ablation.ablate(workload, settings, steps=args.steps, lr=args.lr, device=args.device,
                                  on_step=lambda name, step, loss: progress.update(tasks[name], completed=step,
                                                                                   loss=f"{loss:.4f}"))
    eager, compiled = results[0], results[1]
    rows = [[r.setting, format_bytes(r.saved_bytes), f"{eager.saved_bytes / r.saved_bytes:.2f}x",
             "—" if r.min_cosine is None else f"{r.min_cosine:.4f}",
             "—" if r.median_error is None else f"{r.median_error:.4f}",
             f"{r.final_loss:.4f}", f"{(r.final_loss - compiled.final_loss) / compiled.final_loss:+.2%}",
             f"{r.step_seconds / compiled.step_seconds:.2f}x"] for r in results]
    columns = COLUMNS
    legend = ("grad cosine / error: every trainable gradient on a fixed batch vs the eager model's at the same "
              "weights, probed after calibration, mid-way and at the end (minimum cosine, median relative L2 "
              "error). final loss: mean of the last 5 steps; vs compile: relative to torch.compile's.")
    if compiled.evaluation is not None:
        columns += EVAL_COLUMNS
        for row, r in zip(rows, results, strict=True):
            loss, accuracy = r.evaluation
            row += [f"{loss:.4f}", f"{(loss - compiled.evaluation[0]) / compiled.evaluation[0]:+.2%}",
                    f"{accuracy:.4f}"]
        legend += (" eval loss / accuracy: the trained model's next-token loss and accuracy on held-out text; "
                   "vs compile: relative to torch.compile's.")
    print_table(f"{workload.name}: {args.steps} steps", columns, rows, legend, args, args.device)
    write_json(results, args, args.device)
    return 0
