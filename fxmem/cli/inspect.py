"""`fxmem inspect`: every tensor a model saves for backward, its role and the plan for it."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fxmem.cli.common import add_preset, config_override, console, int_at_least
from fxmem.cli.harness import get_workload, listed_workloads, workload_names
from fxmem.config import PRESETS, Config

if TYPE_CHECKING:
    import torch


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("inspect", help="every tensor a model saves for backward, its role and plan")
    parser.add_argument("model", help=f"a workload ({listed_workloads()}) or a HuggingFace config.json "
                                      "(file or directory)")
    parser.add_argument("--batch", type=int_at_least(1), help="batch size (default: the workload's, else 4)")
    parser.add_argument("--seq", type=int_at_least(1), help="sequence length (default: the workload's, else 512)")
    parser.add_argument("--lora-rank", type=int_at_least(0), default=16, help="LoRA rank; 0 for full fine-tuning")
    add_preset(parser)
    parser.add_argument("--memory-budget", type=_budget, metavar="TARGET",
                        help="the planner's target for each region's saved activations: a fraction of what "
                             "torch.compile saves, or a number of bytes (see README)")
    parser.add_argument("--set", action="append", type=config_override, default=[], metavar="NAME=VALUE",
                        help="override a Config field of the preset (a Python literal: --set block_checkpoint=True); "
                             "repeatable")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=pathlib.Path, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--all", action="store_true", help="also list parameters and inputs (they free nothing)")
    parser.add_argument("--fidelity", action="store_true",
                        help="also run the batch exactly and under --preset: every trainable gradient's cosine, and "
                             "what each compressed saved tensor alone does to the gradients (fxmem.check_fidelity)")
    parser.set_defaults(run=run)


def _loss_of_output(loss: Callable[..., torch.Tensor], batch: dict[str, torch.Tensor], output: Any) -> torch.Tensor:
    """A workload's loss (which runs its forward on the batch) of an output already computed."""
    return loss(lambda **_: output, batch)


def _budget(text: str) -> float | int:
    """An integer is bytes, anything else a fraction (Config.memory_budget validates either)."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def run(args: argparse.Namespace) -> int:
    import torch

    from fxmem.fidelity import check_fidelity
    from fxmem.inspection import inspect as inspect_model
    from fxmem.models import build_lora_model, example_batch, hf_config

    try:
        overrides = {"memory_budget": args.memory_budget, **dict(args.set)}
        config = Config.from_preset(args.preset, **overrides)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    loss = None  # the output's own loss
    if args.model in workload_names():
        workload = get_workload(args.model)
        workload = dataclasses.replace(workload, batch=args.batch or workload.batch, seq=args.seq or workload.seq)
        setup = workload.build(device=args.device, lora_rank=args.lora_rank)
        model, batch = setup.model, next(setup.batches)
        loss = functools.partial(_loss_of_output, setup.loss, batch)  # MiniLM's is contrastive
    else:
        if not pathlib.Path(args.model).exists():
            raise SystemExit(f"{args.model}: neither a workload ({listed_workloads()}) nor an existing "
                             "config.json")
        model_config = hf_config(args.model)
        torch.manual_seed(0)
        model = build_lora_model(model_config, args.lora_rank, torch.float32, device=args.device)
        batch = example_batch(model_config, args.batch or 4, args.seq or 512, args.device)
    # a config.json's model has random weights and an example batch: no data for the guard to check on
    report = inspect_model(model, config=config, guard=args.model in workload_names(), **batch)
    console.print(*report.renderables(include_all=args.all))
    data = report.to_dict()
    if args.fidelity:
        if not config.compresses:
            lossy = [name for name, preset in PRESETS.items() if preset.compresses]
            console.print(f"[yellow]--fidelity: preset {args.preset} compresses nothing; name a lossy one "
                          f"({', '.join(lossy)})[/yellow]")
        try:
            fidelity = check_fidelity(model, batch, args.preset, loss=loss, **overrides)
        except TypeError as error:  # the model's output has no loss
            console.print(f"[red]--fidelity: {error}[/red]")
            return 2
        console.print(*fidelity.renderables())
        data["fidelity"] = fidelity.to_dict()
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
        console.print(f"wrote {args.json}")
    return 0
