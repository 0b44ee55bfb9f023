"""`fxmem bench lowrank-saved`: LoRAct's saved bytes and gradient fidelity per rank ratio, against eager PEFT."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, console, lowrank_rank, print_table
from fxmem_bench.cli.workloads import add_workload, get_workload

NAME = "lowrank-saved"
COLUMNS = ("lowrank", "saved activations", "planned", "reduction vs eager", "norm inputs shared", "min grad cos",
           "median grad rel err")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="LoRAct's saved-activation bytes and gradient fidelity per rank "
                                               "ratio, vs eager PEFT LoRA (one batch)")
    add_workload(parser, "llama-tiny")
    parser.add_argument("--ratios", nargs="+", type=lowrank_rank, default=[0.5, 0.25, 0.125, 0.0625],
                        help="lowrank values: ratios in (0, 1) of the last dimension or integer ranks")
    parser.add_argument("--lowering", choices=["inductor", "eager"], default="inductor",
                        help="eager: run the rewritten aten graphs without code generation (same bytes)")
    add_outputs(parser, json_results=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from fxmem.measure import format_bytes
    from fxmem_bench.lowrank_saved import measure_ratios

    workload = get_workload(args.workload)
    with console.status(f"{workload.name}: eager PEFT, then fxmem at {len(args.ratios)} ratio(s)"):
        results = measure_ratios(workload, args.ratios, lowering=args.lowering)
    eager = results[0].saved_bytes
    rows = [[r.setting, format_bytes(r.saved_bytes),
             "" if r.planned_bytes is None else format_bytes(r.planned_bytes), f"{eager / r.saved_bytes:.2f}x",
             str(r.prenorm_shared), "" if r.fidelity is None else f"{r.fidelity.min_cosine:.4f}",
             "" if r.fidelity is None else f"{r.fidelity.median_relative_error:.4f}"] for r in results]
    legend = (f"{torch.get_num_threads()} thread(s). {workload.name}: {workload.description}, batch "
              f"{workload.batch} x {workload.seq}, LoRA r=16 on every linear, seeded random weights, one batch of "
              "real text. saved: measured (unique storages autograd holds, parameters and inputs excluded); "
              "planned: the cost model's; gradients vs eager PEFT's on the same batch and weights.")
    print_table("fxmem bench lowrank-saved", COLUMNS, rows, legend, args)
    return 0
