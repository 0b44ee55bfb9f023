"""`fxmem bench lora`: one LoRA layer's forward + backward time, RunLoRA's orders against PEFT's layer."""

from __future__ import annotations

import argparse

from fxmem.choices import DTYPE_NAMES
from fxmem.cli.common import add_outputs, console, int_at_least, print_table

NAME = "lora"
COLUMNS = ("tokens, in -> out, rank", "orders", "W products", "FLOPs saved", "PEFT", "runlora", "speed-up",
           "middle half", "orders only")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="one LoRA layer's fwd+bwd time: RunLoRA's orders vs PEFT")
    parser.add_argument("--shapes", nargs="+", required=True, metavar="N,IN,OUT,R",
                        help="tokens (batch x seq), in and out features, rank; e.g. 2048,1024,2752,16")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPE_NAMES))
    parser.add_argument("--steps", type=int_at_least(1), default=10, help="timed steps (median reported)")
    parser.add_argument("--device", default="cpu")
    add_outputs(parser, json_results=False)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.cost_model.lora_orders import LoraShape
    from fxmem.whatif import DTYPES
    from fxmem_bench.lora_layer import time_lora_layer

    rows = []
    for text in args.shapes:
        try:
            shape = LoraShape(*(int(v) for v in text.split(",")), DTYPES[args.dtype])
        except (TypeError, ValueError) as error:
            console.print(f"[red]--shapes takes N,IN,OUT,R (four integers >= 1); got {text!r}: {error}[/red]")
            return 2
        t = time_lora_layer(shape, steps=args.steps, device=args.device)
        rows.append([f"{shape.tokens}, {shape.in_features} -> {shape.out_features}, r={shape.rank}",
                     f"{t.forward}/{t.backward}", "/".join(t.libraries), f"{t.flops_saving:+.1%}",
                     f"{t.peft_seconds * 1000:.1f} ms", f"{t.runlora_seconds * 1000:.1f} ms", f"{t.speedup:.2f}x",
                     "{:.2f}-{:.2f}x".format(*t.speedup_quartiles), f"{t.order_speedup:.2f}x"])
    legend = (f"{args.dtype}. Median of {args.steps} fwd+bwd steps, all timed back to back in each round; speed-up: "
              "median of the rounds' PEFT / runlora ratios, middle half: their quartiles; PEFT: its eager LoRA "
              "Linear (saves x A^T); runlora: fxmem.kernels.runlora.runlora_linear in the FLOPs chooser's orders, "
              "its products with W (forward/backward) in the library measured faster on this device; orders only: "
              "the speed-up with aten's products; FLOPs saved: vs autograd's order")
    print_table("one LoRA layer, forward + backward", COLUMNS, rows, legend, args, args.device)
    return 0
