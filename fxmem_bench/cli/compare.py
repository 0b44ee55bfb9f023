"""`fxmem bench [compare]`: each workload under fxmem and the baselines of docs/methodology.md."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
from typing import TYPE_CHECKING

from fxmem.cli.common import (
    add_device,
    add_outputs,
    add_preset,
    config_override,
    console,
    int_at_least,
    print_table,
    write_json,
)
from fxmem.config import Config, overrides_text
from fxmem_bench.choices import COMPARE_METHODS, FRONTIER_TARGETS
from fxmem_bench.cli.workloads import get_workload, workload_names

if TYPE_CHECKING:
    import torch

    from fxmem_bench.compare import MethodResult
    from fxmem_bench.workloads import Workload

NAME = "compare"
COLUMNS = ("workload", "method", "saved activations", "reduction vs eager", "step peak", "static",
           "peak incl. static", "step time", "vs eager", "vs compile", "min grad cos", "published bound",
           "median grad rel err", "compile s")
LEGEND = {
    "saved activations": "the storages autograd holds for backward after the forward, each once at its full size "
                         "(fxmem.measure.saved_activation_bytes): one measure for every method, compile-budget's "
                         "search included",
    "step peak": "a full training step's peak allocation above what was allocated when it began "
                 "(CPU: profiler allocation events; CUDA: allocator statistics)",
    "static": "weights, buffers and optimizer state",
    "step time": "median of the timed steps, methods timed interleaved in one process; vs eager / vs compile: the "
                 "median of the per-round ratios (min-max over the rounds)",
    "min grad cos / median grad rel err": "trainable gradients vs eager's on the same batch and weights",
    "published bound": "the preset's published worst gradient cosine, which an fxmem row must meet (—: an exact "
                       "method, held to none)",
    "compile s": "first step minus a warm step, every method compiled with inductor's caches off",
}


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="fxmem vs the baselines on the benchmark workloads")
    parser.add_argument("--workloads", nargs="+", choices=workload_names(),
                        help="default: llama-tiny and llama-small, plus llama-7b-shape on a GPU")
    add_preset(parser)
    parser.add_argument("--steps", type=int_at_least(3), default=5,
                        help="interleaved timed rounds, one step of each method per round, at least 3: ratios are "
                             "the median of the per-round ratios, with their min-max range")
    parser.add_argument("--methods", nargs="+", choices=list(COMPARE_METHODS),
                        help="default: fxmem and every baseline that runs on the device and the workload (CUDA only: "
                             "compile-offload, compile-checkpointing-liger where liger-kernel is installed, "
                             "compile-checkpointing-offload; causal LMs only: compile-checkpointing-lce and -liger)")
    add_device(parser)
    parser.add_argument("--dtype", choices=list(DTYPE_CHOICES),
                        help="train in this dtype instead of the workload's own")
    parser.add_argument("--set", action="append", type=config_override, default=[], metavar="NAME=VALUE",
                        help="override a Config field of the preset (a Python literal: --set bits=None); repeatable")
    parser.add_argument("--drop-logits", action="store_true",
                        help="fxmem returns an empty tensor in place of the model's logits (return_logits=False), "
                             "so that it chunks the loss; the step reads only the loss")
    parser.add_argument("--frontier", action="store_true",
                        help="step peak against step time: fxmem (--preset, default hyclora-4bit, with memory_budget "
                             "at each target and any --set, and hyclora-2bit) and compile-budget at the same "
                             "--targets, beside eager, torch.compile and HF checkpointing")
    parser.add_argument("--targets", nargs="+", type=float, default=list(FRONTIER_TARGETS), metavar="FRACTION",
                        help="--frontier's targets, fractions of what torch.compile saves (default 0.5 0.3 0.15 0.08)")
    parser.add_argument("--plot", type=pathlib.Path, metavar="PNG",
                        help="--frontier: draw each workload's frontier (PNG, the workload's name appended)")
    add_outputs(parser)
    parser.set_defaults(run=run)


# Config fields that have their own option here, and what to use instead of --set
OWN_OPTIONS = {"preset": "--preset", "return_logits": "--drop-logits"}


def run(args: argparse.Namespace) -> int:
    import torch

    from fxmem_bench.compare import METHOD_DESCRIPTIONS, check_runs_here, left_out_by_default, run_workload

    device = torch.device(args.device)
    names = args.workloads or ["llama-tiny", "llama-small"] + (["llama-7b-shape"] if device.type == "cuda" else [])
    families = list(dict.fromkeys(get_workload(name).family for name in names))
    try:
        _check_options(args)
        Config.from_preset(args.preset, **dict(args.set))
        for family in families:
            check_runs_here(args.methods or (), device, family)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    if args.frontier:
        return _frontier(args, names, device)
    if args.methods is None:  # the defaults: say what they leave out here, and why
        for family in families:
            for method, why in left_out_by_default(COMPARE_METHODS, device, family).items():
                console.print(f"[yellow]{method} left out of the {family} workloads: {why}[/yellow]")
    results = []
    with console.status("benchmarking") as status:
        for name in names:
            results += run_workload(_in_dtype(get_workload(name), args.dtype), preset=args.preset, device=device,
                                    steps=args.steps, methods=args.methods, return_logits=not args.drop_logits,
                                    options=dict(args.set),
                                    progress=lambda message: status.update(message))
    logits = "; fxmem returns no logits (--drop-logits)" if args.drop_logits else ""
    dtype = f"; in {args.dtype}" if args.dtype else ""
    overrides = overrides_text(args.set)
    legend = f"preset {args.preset}{overrides}{logits}{dtype}; {args.steps} timed steps\n" + "\n".join(
        f"- {name}: {meaning}" for name, meaning in {**METHOD_DESCRIPTIONS, **LEGEND}.items())
    print_table("fxmem bench compare", COLUMNS, rows(results), legend, args, device)
    write_json(results, args, device, preset=args.preset, return_logits=not args.drop_logits, options=dict(args.set))
    return 0


DTYPE_CHOICES = ("bf16", "fp32")  # whatif's names


def _in_dtype(workload: Workload, dtype: str | None) -> Workload:
    from fxmem.whatif import DTYPES
    return workload if dtype is None else dataclasses.replace(workload, dtype=DTYPES[dtype])


def rows(results: list) -> list[list[str]]:
    from fxmem.measure import format_bytes
    from fxmem.timing import round_ratio

    by_key = {(r.workload, r.method): r for r in results}
    table = []
    for r in results:
        eager, compiled = by_key.get((r.workload, "eager")), by_key.get((r.workload, "compile"))
        table.append([
            r.workload, r.label or r.method, format_bytes(r.saved_bytes),
            f"{eager.saved_bytes / r.saved_bytes:.2f}x" if eager and r.saved_bytes else "—",
            format_bytes(r.peak_bytes), format_bytes(r.static_bytes), format_bytes(r.peak_bytes + r.static_bytes),
            f"{r.step_seconds:.3f} s",
            str(round_ratio(r.step_samples, eager.step_samples)) if eager else "—",
            str(round_ratio(r.step_samples, compiled.step_samples)) if compiled else "—",
            f"{r.fidelity.min_cosine:.6f}" if r.fidelity else "(reference)", bound_cell(r),
            f"{r.fidelity.median_relative_error:.1e}" if r.fidelity else "—",
            f"{r.compile_seconds:.1f}" if r.compile_seconds else "—"])
    return table


def bound_cell(r: MethodResult) -> str:
    """The preset's published worst cosine, marked where the point misses it; exact methods: a dash."""
    if r.fidelity_bound is None:
        return "—"
    return f"{r.fidelity_bound:g}" + ("" if r.meets_fidelity_bound else " (missed)")


FRONTIER_COLUMNS = ("workload", "method", "saved activations", "step peak", "step time", "vs compile",
                    "min grad cos", "published bound", "median grad rel err")


def _check_options(args: argparse.Namespace) -> None:
    for name, _ in args.set:
        if name in OWN_OPTIONS:
            raise ValueError(f"--set {name}=...: use {OWN_OPTIONS[name]}")
    if args.frontier and args.dtype:
        raise ValueError("--frontier runs in the workload's dtype: drop --dtype")
    if args.frontier and "memory_budget" in dict(args.set):
        raise ValueError("--frontier sets memory_budget to each of --targets: drop --set memory_budget")


def _frontier(args: argparse.Namespace, names: list[str], device: torch.device) -> int:
    from fxmem.measure import format_bytes
    from fxmem.timing import round_ratio
    from fxmem_bench.frontier import plot, run_frontier, wins

    for target in args.targets:
        if not 0 < target <= 1:
            console.print(f"[red]--targets are fractions in (0, 1]; got {target}[/red]")
            return 2
    preset = args.preset if args.preset != "exact" else "hyclora-4bit"
    by_workload = {}
    with console.status("frontier") as status:
        for name in names:
            by_workload[name] = run_frontier(get_workload(name), targets=args.targets, preset=preset,
                                             overrides=dict(args.set), device=device,
                                             steps=args.steps, progress=lambda message: status.update(message))
    rows, verdicts = [], []
    for name, ours in by_workload.items():
        compiled = next(r for r in ours if r.method == "compile")
        rows += [[name, r.label, format_bytes(r.saved_bytes), format_bytes(r.peak_bytes), f"{r.step_seconds:.3f} s",
                  str(round_ratio(r.step_samples, compiled.step_samples)),
                  f"{r.fidelity.min_cosine:.6f}" if r.fidelity else "(reference)",
                  bound_cell(r),
                  f"{r.fidelity.median_relative_error:.1e}" if r.fidelity else "—"] for r in ours]
        for theirs, winner in wins(ours):
            verdicts.append(f"{name}, {theirs.label} ({format_bytes(theirs.peak_bytes)}, "
                            f"{round_ratio(theirs.step_samples, compiled.step_samples)}): " + (
                                f"{winner.label} is below and faster, ranges apart ({format_bytes(winner.peak_bytes)}"
                                f", {round_ratio(winner.step_samples, compiled.step_samples)})" if winner
                                else "no fxmem point is as low, faster with the ranges apart, and within its "
                                     "published gradient fidelity"))
        if args.plot:
            path = args.plot.with_name(f"{args.plot.stem}-{name}{args.plot.suffix or '.png'}")
            plot(ours, path)
            console.print(f"wrote {path}")
    settings = "".join(f", {name}={value}" for name, value in args.set)
    legend = (f"targets {', '.join(f'{t:g}' for t in args.targets)} of what torch.compile saves; fxmem: {preset}"
              f"{settings} with memory_budget at each, then hyclora-2bit; compile-budget: activation_memory_budget "
              "at each. "
              f"{args.steps} timed steps, every method interleaved in one process. An fxmem point wins a "
              f"compile-budget point only at its preset's published worst gradient cosine or above (published "
              f"bound; —: an exact method, held to none).\n- step peak: {LEGEND['step peak']}"
              "\n" + "\n".join(verdicts))
    print_table("fxmem bench compare --frontier", FRONTIER_COLUMNS, rows, legend, args, device)
    write_json([r for ours in by_workload.values() for r in ours], args, device, preset=preset,
               targets=args.targets)
    return 0
