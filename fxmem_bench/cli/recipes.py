"""`fxmem bench recipes`: the recipes people run (dropout, autocast, packing, accumulation, QLoRA) under each
preset, against torch.compile on the same recipe."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fxmem.cli.common import add_device, add_outputs, config_override, console, print_table, write_json
from fxmem.config import PRESETS
from fxmem_bench.choices import RECIPE_PRESETS, RECIPES
from fxmem_bench.cli.workloads import get_workload, workload_names

if TYPE_CHECKING:
    from fxmem_bench.recipes import RecipeResult
    from fxmem_bench.workloads import Workload

NAME = "recipes"


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="saved bytes and gradient fidelity of each preset under the recipes "
                                               "people run, against torch.compile on the same recipe")
    parser.add_argument("--workload", default="llama-tiny", choices=workload_names("llama"))
    parser.add_argument("--recipes", nargs="+", choices=RECIPES, default=list(RECIPES))
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(RECIPE_PRESETS))
    parser.add_argument("--set", action="append", type=config_override, default=[], metavar="NAME=VALUE",
                        help="override a Config field of every preset; repeatable")
    add_device(parser)
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem_bench.recipes import measure

    workload = get_workload(args.workload)
    done: list[RecipeResult] = []

    def show(result: RecipeResult) -> None:  # each result written as it comes: a long run may be cut short
        console.print(f"{result.recipe} / {result.method}: planned {result.planned_bytes / 2**20:.3f} MiB, "
                      f"min cosine {result.min_cosine:.6f}, {len(result.fallbacks)} fallback(s)")
        done.append(result)
        write_json(done, args, args.device, workload=workload.name, options=dict(args.set))

    try:
        results = measure(workload, args.recipes, args.presets, device=args.device, options=dict(args.set),
                          on_result=show)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    print_table(f"fxmem bench recipes: {workload.name}", *_table(results, workload), args, args.device)
    return 0


def _table(results: list[RecipeResult], workload: Workload) -> tuple[list[str], list[list[str]], str]:
    from fxmem.config import PUBLISHED_MIN_COSINE
    from fxmem.measure import format_bytes
    from fxmem_bench.recipes import MICRO_BATCHES, RECIPE_DROPOUT

    plain = {r.method: r.planned_bytes for r in results if r.recipe == "plain"}
    columns = ["recipe", "preset", "torch.compile saves", "fxmem plans", "vs plain recipe", "min grad cos",
               "gradients compared", "published bound", "max grad rel err", "fell back"]
    rows = []
    for r in results:
        against = f"{r.planned_bytes / plain[r.method]:.2f}x" if plain.get(r.method) else "—"
        bound = PUBLISHED_MIN_COSINE.get(r.method)
        missed = " (missed)" if bound and r.min_cosine < bound else ""
        rows.append([r.recipe, r.method, format_bytes(r.saved_bytes), format_bytes(r.planned_bytes), against,
                     f"{r.min_cosine:.6f}", str(r.compared), f"{bound}{missed}" if bound else "—",
                     f"{r.max_relative_error:.1e}", "; ".join(r.fallbacks) or "no"])
    legend = (f"Each recipe from the same weights (LoRA r=16 on every linear, B drawn with std {workload.lora_b_std} "
              "past PEFT's zeros) and seed, so the same dropout masks. plain: the workload as it is; dropout: "
              f"lora_dropout={RECIPE_DROPOUT}; autocast: the fp32 model's forward under torch.autocast in bf16; "
              "packed: the batch's rows cut into documents flattened into one row, position_ids restarting per "
              f"document; accumulation: {MICRO_BATCHES} micro-batches, one backward each; qlora: an NF4 base "
              "(bitsandbytes, peft's prepare_model_for_kbit_training). torch.compile saves / fxmem plans: saved "
              "activation bytes from fxmem's report, before and after its plan; vs plain recipe: the plan against "
              "the same preset's on the plain recipe. min grad cos, max grad rel err: every trainable gradient "
              "against torch.compile's on the same recipe. fell back: what strict mode raised or a FallbackWarning "
              "said.")
    return columns, rows, legend
