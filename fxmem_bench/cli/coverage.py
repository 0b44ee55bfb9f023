"""`fxmem bench coverage`: saved bytes, gradient fidelity and the largest kept-exact reasons per model family."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fxmem.cli.common import add_outputs, console, print_table, write_json
from fxmem.config import PRESETS, PUBLISHED_MIN_COSINE
from fxmem_bench.choices import COVERAGE_DTYPES, COVERAGE_FAMILIES

if TYPE_CHECKING:
    from fxmem_bench.coverage import CoverageResult

NAME = "coverage"
COLUMNS = ("family", "dtype", "preset", "eager saved", "fxmem saved", "reduction", "vs llama", "min grad cos",
           "published bound", "largest kept exact")
DEFAULT_PRESETS = ("exact", "hyclora-4bit", "hyclora-2bit")
REFERENCE = "llama"


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="tiny configs of transformers' families under fxmem: saved bytes vs "
                                               "eager, gradient fidelity, and why bytes are kept exact")
    parser.add_argument("--families", nargs="+", choices=list(COVERAGE_FAMILIES), default=list(COVERAGE_FAMILIES))
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(DEFAULT_PRESETS))
    parser.add_argument("--dtypes", nargs="+", choices=list(COVERAGE_DTYPES), default=list(COVERAGE_DTYPES),
                        help="the models' dtypes; bf16 with PEFT's float32 adapters")
    parser.add_argument("--steps", type=int, default=0,
                        help="also train each family this many AdamW steps under fxmem and compare its gradients "
                             "with eager's again (the issue's bar: 50)")
    parser.add_argument("--lowering", choices=["eager", "inductor"], default="eager",
                        help="eager: the rewritten aten graphs run without code generation (the same bytes)")
    add_outputs(parser)
    parser.set_defaults(run=run)


def _bound(result: CoverageResult) -> str:
    """The preset's published worst cosine, marked where the family misses it."""
    bound = PUBLISHED_MIN_COSINE.get(result.preset)
    if bound is None:
        return "—"
    return f"{bound:g}" + ("" if result.fidelity.min_cosine >= bound else " (missed)")


def _kept(result: CoverageResult, top: int = 2) -> str:
    from fxmem.measure import format_bytes
    return "; ".join(f"{reason} ({format_bytes(entry['bytes'])})" for reason, entry in list(result.kept.items())[:top])


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem_bench.coverage import (
        BATCH,
        HIDDEN,
        LAYERS,
        LEARNING_RATE,
        LORA_B_STD,
        LORA_RANK,
        SEQ,
        get_family,
        measure,
    )

    if args.steps < 0:
        console.print(f"[red]--steps must be 0 (no training) or more; got {args.steps}[/red]")
        return 2
    families = [get_family(name) for name in dict.fromkeys([REFERENCE, *args.families])]
    results: list[CoverageResult] = []
    with console.status("") as status:
        for dtype in args.dtypes:
            for family in families:
                status.update(f"{family.name} in {dtype}: eager PEFT, then {', '.join(args.presets)}")
                results += measure(family, args.presets, lowering=args.lowering, steps=args.steps, dtype=dtype)
    reference = {(r.dtype, r.preset): r.reduction for r in results if r.family == REFERENCE}
    columns = list(COLUMNS)
    if args.steps:
        columns.insert(columns.index("min grad cos") + 1, f"after {args.steps} steps")
    rows = [[r.family, r.dtype, r.preset, format_bytes(r.eager_bytes), format_bytes(r.saved_bytes),
             f"{r.reduction:.2f}x", f"{r.reduction / reference[r.dtype, r.preset]:.0%}", f"{r.fidelity.min_cosine:.4f}",
             *([f"{r.trained_fidelity.min_cosine:.4f}"] if r.trained_fidelity else []), _bound(r), _kept(r)]
            for r in results if r.family in args.families]
    patterns = "; ".join(f"{f.name}: {f.patterns}" for f in families)
    legend = (f"Tiny configs: {LAYERS} layers, hidden {HIDDEN}, LoRA r={LORA_RANK} on every linear (B drawn with std "
              f"{LORA_B_STD} past PEFT's zeros), dropout off, "
              f"use_cache=False, batch {BATCH} x {SEQ} bytes of real text (the standard library's source), "
              f"bf16 with PEFT's float32 adapters, {args.lowering} lowering. saved: bytes "
              "autograd holds for backward (unique storages, parameters and inputs left out). vs llama: the "
              "family's reduction over llama's at the same preset. min grad cos: LoRA gradients against eager "
              "PEFT's at the initial weights (after N steps: the same batch, at the weights N AdamW steps at lr "
              f"{LEARNING_RATE:g} under fxmem reached, each on a new batch). largest kept exact: the plan's keep "
              "reasons by bytes "
              f"(Report.kept_by_reason). Patterns: {patterns}.")
    print_table("fxmem bench coverage", columns, rows, legend, args)
    write_json(results, args)
    return 0
