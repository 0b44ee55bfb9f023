"""`fxmem bench distributed`: DDP and FSDP2 (torchrun, two gloo processes) against one process on the global batch."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fxmem.cli.common import add_outputs, add_preset, console, int_at_least, print_table
from fxmem.config import CALIBRATION_CHOICES
from fxmem_bench.cli.workloads import add_workload, get_workload

NAME = "distributed"
COLUMNS = ("mode", "final loss", "max loss diff", "LoRA vs one process", "LoRA vs one process exact",
           "saved per rank", "planned per rank")
RANKS = 2


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="DDP and FSDP2 under fxmem (two CPU processes, torchrun) against "
                                               "one process on the same global batch")
    add_workload(parser, "llama-tiny")
    add_preset(parser)
    parser.add_argument("--calibration", choices=CALIBRATION_CHOICES, default="dynamic",
                        help="static: each rank freezes the scales of its own parts of the batches")
    parser.add_argument("--steps", type=int_at_least(1), default=3)
    parser.add_argument("--lr", type=float, default=1.0, help="SGD: large, so that differences show")
    add_outputs(parser, json_results=False)
    parser.set_defaults(run=run)


def _launch(mode: str, args: argparse.Namespace) -> list[dict]:
    """torchrun, two processes, each a rank of fxmem_bench.distributed."""
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "ranks.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
                   "-m", "fxmem_bench.distributed", "--mode", mode, "--workload", args.workload, "--preset",
                   args.preset, "--calibration", args.calibration, "--steps", str(args.steps), "--lr", str(args.lr),
                   "--out", str(out)]
        finished = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                                  text=True)
        if finished.returncode != 0:
            raise RuntimeError(f"torchrun {mode} failed:\n{finished.stderr[-3000:]}")
        return json.loads(out.read_text())


def run(args: argparse.Namespace) -> int:
    import torch

    from fxmem.measure import format_bytes
    from fxmem_bench.distributed import relative_distance, train

    workload = get_workload(args.workload)
    console.print(f"{workload.name}: {args.steps} SGD steps (lr {args.lr}) of the global batch "
                  f"{workload.batch} x {workload.seq}, {RANKS} ranks on this CPU (gloo), preset {args.preset}")
    with console.status("one process") as status:
        single = {preset: train(workload, "single", preset=preset, calibration=args.calibration, steps=args.steps,
                                lr=args.lr)
                  for preset in dict.fromkeys(("exact", args.preset))}
        torch._dynamo.reset()
        runs = {}
        for mode in ("ddp", "fsdp2"):
            status.update(f"torchrun {mode}")
            runs[mode] = _launch(mode, args)
    reference, exact = single[args.preset], single["exact"]
    rows = [["one process", f"{reference['losses'][-1]:.6f}", "—", "—",
             f"{relative_distance(exact['lora'], reference['lora']):.2e}", "—", format_bytes(reference["planned_bytes"])]]
    for mode, ranks in runs.items():
        first = ranks[0]
        saved = "—" if first["saved_bytes"] is None else " / ".join(format_bytes(r["saved_bytes"]) for r in ranks)
        rows.append([mode, f"{first['losses'][-1]:.6f}",
                     f"{max(abs(a - b) for a, b in zip(first['losses'], reference['losses'], strict=True)):.1e}",
                     f"{relative_distance(reference['lora'], first['lora']):.2e}",
                     f"{relative_distance(exact['lora'], first['lora']):.2e}", saved,
                     " / ".join(format_bytes(r["planned_bytes"]) for r in ranks)])
    legend = (f"one process: the global batch in one forward. ddp: DistributedDataParallel over the model compiled "
              f"in place (fxmem.compile_). fsdp2: each decoder block compiled and sharded (fully_shard), then the "
              f"model. Each rank takes 1/{RANKS} of every batch. LoRA vs ...: the largest relative L2 distance of a "
              "LoRA weight after the last step. saved per rank: measured on the first step (DDP; FSDP2's "
              "unsharded parameters are not told apart); planned: fxmem's report on that rank (FSDP2: its blocks)")
    print_table(f"fxmem bench distributed: {workload.name}, {args.preset}", COLUMNS, rows, legend, args)
    return 0
