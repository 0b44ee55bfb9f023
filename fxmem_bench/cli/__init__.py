"""`fxmem bench <experiment>`: the experiment harness (fxmem_bench) from the command line, one module each.

`fxmem bench` with options but no experiment name runs `compare`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fxmem_bench.cli import (
    ablate,
    compare,
    context,
    coverage,
    distributed,
    fidelity,
    finetune,
    gpu_check,
    guard,
    hift,
    loqt,
    lora,
    loss,
    lowrank_error,
    lowrank_saved,
    plans,
    pretrain,
    profile,
    ptxas,
    recipes,
    report,
)

EXPERIMENTS = {module.NAME: module for module in (compare, ablate, finetune, profile, lora, loss, hift, loqt,
                                                  lowrank_error, lowrank_saved, ptxas, distributed,
                                                  coverage, pretrain, fidelity, report, context, gpu_check,
                                                  recipes, plans, guard)}


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("bench", help="the experiments behind docs/benchmarks.md (default: compare)",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    experiments = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for module in EXPERIMENTS.values():
        module.add_parser(experiments)


def with_default_experiment(argv: Sequence[str]) -> list[str]:
    """``argv`` with `compare` filled in after `bench` when no experiment is named."""
    argv = list(argv)
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in (*EXPERIMENTS, "-h", "--help")):
        return ["bench", "compare", *argv[1:]]
    return argv
