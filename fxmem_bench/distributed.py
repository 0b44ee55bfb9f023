"""`fxmem bench distributed`: data-parallel LoRA training under fxmem against one process on the same global batch.

Each mode trains a few SGD steps from the same weights on the same batches:

- ``single``: one process on the whole global batch (its mean loss is the average of the ranks' equal-sized
  parts' means, so the gradients agree);
- ``accumulate``: one process on each rank's part in turn, the gradients averaged: DDP's arithmetic, each part
  compressed on its own as a rank compresses it, so DDP under a lossy preset should match it to rounding;
- ``ddp``: ``DistributedDataParallel`` over the model compiled in place with fxmem (``fxmem.compile_``);
- ``fsdp2``: as torchtitan does it, each decoder block compiled with fxmem and sharded with ``fully_shard``, then
  the whole model sharded.

Run a distributed mode under torchrun, one process a rank (gloo, on the CPU):

    torchrun --nproc_per_node 2 -m fxmem_bench.distributed --mode ddp --preset hyclora-4bit --out ddp.json

Each rank calibrates (and quantizes) on its own part of the batch, with no communication in the forward (static
calibration too: benchmarks/distributed_calibration.py measures it against statistics reduced across ranks).
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fxmem.backend import Backend
from fxmem.config import CALIBRATION_CHOICES, Config
from fxmem.measure import model_tensors, saved_activation_bytes
from fxmem_bench.workloads import Workload, get_workload

MODES = ("single", "accumulate", "ddp", "fsdp2")
ONE_PROCESS = ("single", "accumulate")


def train(workload: Workload, mode: str, *, preset: str = "exact", calibration: str = "dynamic", steps: int = 3,
          lr: float = 1.0, ranks: int = 2) -> dict[str, Any]:
    """``steps`` SGD steps of ``mode``; in a distributed mode, this process's rank of an initialized group.
    Returns the global losses, this rank's saved bytes (planned; measured on the first step under DDP) and the
    LoRA weights at the end (full tensors, gathered under FSDP2)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    rank, world = (0, ranks) if mode in ONE_PROCESS else (dist.get_rank(), dist.get_world_size())
    setup = workload.build()
    model = setup.model
    batches = [next(setup.batches) for _ in range(steps)]
    backend = Backend(Config.from_preset(preset, calibration=calibration))
    forward: Any = model
    if mode in ONE_PROCESS:
        model.compile(backend=backend)
    elif mode == "ddp":
        forward = torch.nn.parallel.DistributedDataParallel(model)
        model.compile(backend=backend)
    else:
        from torch.distributed.fsdp import fully_shard
        for block in _decoder_blocks(model):
            block.compile(backend=backend)
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    # DDP's graph whole: dynamo's DDPOptimizer would split it at DDP's gradient buckets, and the tensors crossing
    # a split are one region's inputs, which fxmem cannot compress (llama-tiny, hyclora-4bit: 8.73 MiB a rank
    # saved instead of 5.81)
    with torch._dynamo.config.patch(optimize_ddp=False):
        losses, saved = _steps(forward, model, optimizer, batches, mode, rank, world)
    lora = {name: _full(p).tolist() for name, p in model.named_parameters() if p.requires_grad}
    return {"mode": mode, "preset": preset, "calibration": calibration, "rank": rank, "world": world, "losses": losses,
            "saved_bytes": saved, "planned_bytes": backend.report().planned_bytes, "lora": lora}


def _steps(forward: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           batches: list[dict[str, torch.Tensor]], mode: str, rank: int, world: int) -> tuple[list[float], int | None]:
    """The training steps: the global losses, and this rank's saved bytes on the first step (DDP)."""
    losses: list[float] = []
    saved: int | None = None
    for batch in batches:
        parts = [{k: v.chunk(world)[r] for k, v in batch.items()} for r in range(world)]  # each rank's part
        part = parts[rank]
        if mode == "single":  # the global batch at once: the mean over its tokens, as the ranks' average is
            loss = forward(**batch).loss
        elif mode == "accumulate":  # each part's mean loss, its gradient averaged (both graphs held at once: a
            # reference for the gradients, not for memory)
            loss = sum(forward(**p).loss for p in parts) / world
        elif saved is None and mode == "ddp":  # FSDP2's unsharded parameters are no model tensor to leave out
            saved, output = saved_activation_bytes(lambda: forward(**part), model_tensors(model) + list(part.values()))
            loss = output.loss
        else:
            loss = forward(**part).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        global_loss = loss.detach().clone()
        if mode not in ONE_PROCESS:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(global_loss.item())
    return losses, saved


def _decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the model's largest ModuleList."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of blocks to shard")
    return list(max(lists, key=len))


def _full(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor: an FSDP2 shard gathered."""
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter.detach()


def relative_distance(a: dict[str, list], b: dict[str, list]) -> float:
    """The largest relative L2 distance between two runs' LoRA weights, parameter by parameter."""
    worst = 0.0
    for name, values in a.items():
        x, y = torch.tensor(values, dtype=torch.float64), torch.tensor(b[name], dtype=torch.float64)
        worst = max(worst, ((x - y).norm() / x.norm().clamp_min(1e-30)).item())
    return worst


def run_rank(workload: Workload, mode: str, out: pathlib.Path, **options: Any) -> None:
    """One torchrun process: join the group (gloo: the CPU), train, and on rank 0 write every rank's result."""
    dist.init_process_group("gloo")
    try:
        result = train(workload, mode, **options)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=[m for m in MODES if m not in ONE_PROCESS], required=True)
    parser.add_argument("--workload", default="llama-tiny")
    parser.add_argument("--preset", default="exact")
    parser.add_argument("--calibration", choices=CALIBRATION_CHOICES, default="dynamic")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="rank 0 writes every rank's result here")
    args = parser.parse_args(argv)
    run_rank(get_workload(args.workload), args.mode, args.out, preset=args.preset, calibration=args.calibration,
             steps=args.steps, lr=args.lr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
