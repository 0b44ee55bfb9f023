"""`fxmem bench guard`: the guard's figures (fxmem_bench/guard.py): settings that bend the gradient and the presets as
shipped, without and with it; with --cost, what it adds to a training run."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, int_at_least, print_table, write_json
from fxmem_bench.choices import COVERAGE_DTYPES, GUARD_BENT_SETTINGS, GUARD_PRESETS, WORKLOAD_FAMILIES

NAME = "guard"


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="the guard: bent settings and the presets without and with it; "
                                               "--cost: its step time and peak in training")
    parser.add_argument("--settings", nargs="+", choices=[*GUARD_BENT_SETTINGS, *GUARD_PRESETS],
                        default=[*GUARD_BENT_SETTINGS, *GUARD_PRESETS])
    parser.add_argument("--dtypes", nargs="+", choices=list(COVERAGE_DTYPES), default=["fp32"])
    parser.add_argument("--cost", action="store_true",
                        help="instead: train --workload --steps steps guarded and unguarded, timed, and a checked "
                             "step's peak")
    parser.add_argument("--workload", choices=list(WORKLOAD_FAMILIES), default="llama-small")
    parser.add_argument("--preset", default="hyclora-4bit", choices=list(GUARD_PRESETS))
    parser.add_argument("--steps", type=int_at_least(2), default=200)
    parser.add_argument("--every", type=int_at_least(1), default=100,
                        help="the guard's guard_every in the run (a re-check measured within --steps)")
    parser.add_argument("--device", default="cpu", help="--cost's device (cpu, cuda)")
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.config import Config


    if args.cost:
        from fxmem_bench.guard import cost
        from fxmem_bench.workloads import get_workload

        result = cost(get_workload(args.workload), args.preset, steps=args.steps, every=args.every,
                      device=args.device)
        step, every = result.step_seconds_unguarded, Config().guard_every
        rows = [[result.workload, result.preset, str(result.steps), str(result.every), str(len(result.checks)),
                 f"{result.first_check_seconds / step:.1f}", f"{result.recheck_seconds / step:.2f}",
                 f"{result.amortized(every=every, first=False):.2%}", f"{result.amortized(every=every):.2%}",
                 f"{result.unchecked_step_ratio:.2f}x", f"{result.peak_checked / result.peak_unguarded:.3f}x"]]
        columns = ("workload", "preset", "steps", "every", "checks", "first check (steps)", "re-check (steps)",
                   f"re-checks over 1000 steps, every {every}", "with the first", "unchecked step",
                   "checked step's peak")
        legend = ("Each step an AdamW step of fxmem.compile_'s model, the guard checking every `every` forwards. "
                  "first check, re-check: their seconds over the unguarded model's median step; over 1000 steps: "
                  f"the re-checks at the default guard_every ({every}), and the first check, over 1000 unguarded "
                  "steps' time; unchecked step: the guarded "
                  "model's median step without a check over the unguarded one's (the mended plan's own cost); "
                  "checked step's peak: a step the guard checks before (its probed compile kept) over an unguarded "
                  "step, each above its start. " + "; ".join(c.summary() for c in result.checks))
        print_table("fxmem bench guard --cost", columns, rows, legend, args, args.device)
        write_json([result], args, args.device)
        return 0
    from fxmem_bench.guard import BENT_BOUND, settings

    results = [r for dtype in args.dtypes for r in settings(tuple(args.settings), dtype)]
    rows = [[r.setting, r.family, r.preset, r.dtype, f"{r.check.bound:g}",
             f"{r.unguarded.min_cosine:.4f}", f"{r.eager_bytes / r.unguarded_bytes:.2f}x",
             f"{r.guarded.min_cosine:.4f}", f"{r.eager_bytes / r.guarded_bytes:.2f}x", str(len(r.check.demotions)),
             f"{r.check.seconds:.1f} s"] for r in results]
    columns = ("setting", "family", "preset", "dtype", "bound", "cos unguarded", "eager / saved", "cos guarded",
               "eager / saved guarded", "demoted", "guard time")
    legend = (f"Tiny coverage models (fxmem_bench/coverage.py: LoRA on every linear, B past init, real text). The bent "
              f"settings are checked at a bound of {BENT_BOUND}, the presets at their own. cos: the worst LoRA "
              "gradient's cosine against eager PEFT's on the whole batch; eager / saved: eager's saved bytes over "
              "fxmem's; the guard checks a slice of the batch (its first tokens) and demotes until the bound holds "
              "there. " + "; ".join(f"{r.setting} ({r.dtype}): {r.check.summary()}" for r in results))
    print_table("fxmem bench guard", columns, rows, legend, args)
    write_json(results, args)
    return 0
