"""`fxmem bench pretrain`: build (or check) the llama-pretrained workload's weights in the user's cache."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, console, print_table

NAME = "pretrain"
COLUMNS = ("step", "held-out code loss (nats/byte)", "next-byte accuracy")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(
        NAME, help="build the llama-pretrained weights (byte-level Llama pretrained on the standard library's code, "
                   "docstrings removed) in the cache, or check the cached ones against their hash")
    parser.add_argument("--rebuild", action="store_true", help="pretrain again even if a checked build is cached")
    add_outputs(parser, json_results=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem_bench import pretrained

    recipe = pretrained.RECIPE
    directory = pretrained.checkpoint_dir(recipe)
    if args.rebuild or pretrained.read_manifest(recipe) is None:
        console.print(f"pretraining {recipe} into {directory}")
        pretrained.build(recipe, on_eval=lambda step, loss, accuracy: console.print(
            f"step {step:5d}: held-out loss {loss:.4f}, accuracy {accuracy:.4f}"))
    try:
        pretrained.verified_checkpoint(recipe)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 1
    manifest = pretrained.read_manifest(recipe)
    rows = [[str(point["step"]), f"{point['eval_loss']:.4f}", f"{point['eval_accuracy']:.4f}"]
            for point in manifest["eval_curve"]]
    legend = (f"{directory}: sha256 {manifest['sha256']} (checked), built in {manifest['seconds'] / 60:.1f} min on "
              f"{manifest['threads']} thread(s), torch {manifest['torch']}. Held out: one code file in "
              f"{recipe.held_out_every}, its first {recipe.eval_windows} windows of {recipe.seq} bytes.")
    print_table("llama-pretrained: pretraining curve", COLUMNS, rows, legend, args)
    return 0
