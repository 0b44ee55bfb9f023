"""`fxmem bench loss`: the LM head and its cross-entropy alone, fxmem's chunked loss against torch's ways."""

from __future__ import annotations

import argparse

from fxmem.choices import DTYPE_NAMES
from fxmem.cli.common import add_outputs, console, int_at_least, print_table, write_json
from fxmem_bench.choices import LOSS_METHODS

NAME = "loss"
COLUMNS = ("method", "peak", "vs unfused", "step time", "vs unfused", "loss rel err", "max grad rel err")


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="LM head + cross-entropy alone: fxmem's chunked loss vs torch's")
    parser.add_argument("--tokens", type=int_at_least(1), default=2048)
    parser.add_argument("--hidden", type=int_at_least(1), default=1024)
    parser.add_argument("--vocab", type=int_at_least(2), default=128256, help="default: Llama 3's vocabulary")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPE_NAMES))
    parser.add_argument("--train-head", action="store_true", help="the head's weight trains too (default frozen)")
    parser.add_argument("--methods", nargs="+", choices=list(LOSS_METHODS), default=list(LOSS_METHODS),
                        help="default: all; the unfused eager loss always runs, as the reference")
    parser.add_argument("--steps", type=int_at_least(1), default=3, help="timed steps per method (median reported)")
    parser.add_argument("--device", default="cpu")
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem.whatif import DTYPES
    from fxmem_bench.loss import LOSS_METHOD_DESCRIPTIONS, LossShape, run_loss

    shape = LossShape(args.tokens, args.hidden, args.vocab, DTYPES[args.dtype])
    with console.status("loss") as status:
        results = run_loss(shape, methods=tuple(args.methods), steps=args.steps, train_head=args.train_head,
                           device=args.device, progress=lambda message: status.update(message))
    unfused = results[0]
    rows = [[r.method, format_bytes(r.peak_bytes), f"{r.peak_bytes / unfused.peak_bytes:.2f}x",
             f"{r.step_seconds:.3f} s", f"{r.step_seconds / unfused.step_seconds:.2f}", f"{r.loss_error:.1e}",
             f"{r.grad_error:.1e}"] for r in results]
    head = "weight trains" if args.train_head else "weight frozen"
    legend = (f"{args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab}, {args.dtype}, head {head}; "
              f"loss + backward, {args.steps} timed steps interleaved\n"
              + "\n".join(f"- {name}: {meaning}" for name, meaning in LOSS_METHOD_DESCRIPTIONS.items()))
    print_table("fxmem bench loss", COLUMNS, rows, legend, args, args.device)
    write_json(results, args, args.device, tokens=args.tokens, hidden=args.hidden, vocab=args.vocab,
               dtype=args.dtype, train_head=args.train_head)
    return 0
