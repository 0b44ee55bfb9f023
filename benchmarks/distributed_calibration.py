"""Static calibration under DDP: each rank's own statistics (fxmem's) against statistics reduced across ranks.

    python benchmarks/distributed_calibration.py out.json

llama-tiny, hyclora-4bit with calibration="static" (5 calibrating forwards), 8 SGD steps at lr 1.0 on the same
global batches, against one process. The reduced variant all-reduces each calibrating batch's statistics (min,
max, sum) before the slot adds them; fxmem does not (a collective in the forward is unsafe when ranks recompile
at different steps). Results: docs/benchmarks.md, "DDP and FSDP2".
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from fxmem.kernels import calibration
from fxmem_bench.distributed import relative_distance, run_rank, train
from fxmem_bench.workloads import get_workload

STEPS = 8


def _observe_reduced(observe):
    def reduced(slot, low, high, square_norm):
        if slot.frozen is None:
            low, high, square_norm = low.clone(), high.clone(), square_norm.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN)
            dist.all_reduce(high, op=dist.ReduceOp.MAX)
            dist.all_reduce(square_norm)
        return observe(slot, low, high, square_norm)
    return reduced


def rank_main(variant: str, out: str) -> None:
    if variant == "reduced":
        calibration.QuantSlot.observe = _observe_reduced(calibration.QuantSlot.observe)
    run_rank(get_workload("llama-tiny"), "ddp", pathlib.Path(out), preset="hyclora-4bit", calibration="static",
             steps=STEPS)


def main(out: str) -> None:
    workload = get_workload("llama-tiny")
    runs = {}
    for name, preset, calibration_kind in (("one process exact", "exact", "dynamic"),
                                           ("one process static", "hyclora-4bit", "static"),
                                           ("one process dynamic", "hyclora-4bit", "dynamic")):
        torch._dynamo.reset()
        runs[name] = train(workload, "single", preset=preset, calibration=calibration_kind, steps=STEPS)
    for variant in ("per-rank", "reduced"):
        with tempfile.TemporaryDirectory() as directory:
            ranks_out = pathlib.Path(directory) / "ranks.json"
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            __file__, "--rank", variant, str(ranks_out)],
                           env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, capture_output=True)
            runs[f"ddp static {variant}"] = json.loads(ranks_out.read_text())[0]
    exact, static = runs["one process exact"]["lora"], runs["one process static"]["lora"]
    table = {name: {"losses": run["losses"], "lora_vs_one_process_exact": relative_distance(exact, run["lora"]),
                    "lora_vs_one_process_static": relative_distance(static, run["lora"])}
             for name, run in runs.items()}
    for name, row in table.items():
        print(f"{name:22s} final loss {row['losses'][-1]:.6f}  LoRA vs one process exact "
              f"{row['lora_vs_one_process_exact']:.2e}, vs one process static {row['lora_vs_one_process_static']:.2e}")
    pathlib.Path(out).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        rank_main(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
