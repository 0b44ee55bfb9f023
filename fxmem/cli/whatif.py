"""`fxmem whatif`: memory per preset and LoRA orders of a model before running it (no GPU, no weights)."""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.markup import escape

from fxmem.choices import BASES, CONTEXT_GRANULARITY, DTYPE_NAMES, MAX_CONTEXT_PRESETS, NAMED_SHAPES, OPTIMIZER_STATES
from fxmem.cli.common import (
    add_outputs,
    byte_size,
    config_override,
    console,
    int_at_least,
    provenance_line,
    run_metadata,
    show_table,
    write_json,
    write_markdown,
)
from fxmem.cli.harness import get_workload, listed_workloads, workload_names
from fxmem.config import PRESETS
from fxmem.fallback import STRICT_ENV, FallbackError

if TYPE_CHECKING:
    from fxmem.whatif import ContextFit, TraceNote, WhatIf


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("whatif", help="memory per preset and LoRA orders of a model, before running it "
                                                "(no GPU, no weights: traced on fake tensors)")
    parser.add_argument("model", help=f"a named shape ({', '.join(NAMED_SHAPES)}), a workload "
                                      f"({listed_workloads()}) or a HuggingFace config.json")
    parser.add_argument("--batch", type=int_at_least(1), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=512)
    parser.add_argument("--rank", type=int_at_least(1), default=16, help="LoRA rank")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPE_NAMES))
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES))
    parser.add_argument("--shards", type=int_at_least(1), default=1,
                        help="FSDP2 over this many ranks: per rank, 1/shards of the weights, gradients and optimizer "
                             "state (--batch is a rank's batch)")
    parser.add_argument("--base", default="float", choices=list(BASES),
                        help="nf4: QLoRA, the LoRA-targeted frozen weights stored as bitsandbytes' NF4")
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), help="default: every preset")
    parser.add_argument("--plot", type=pathlib.Path, metavar="PNG", help="draw the breakdown as stacked bars")
    parser.add_argument("--max-context", type=byte_size, metavar="SIZE",
                        help="instead: the longest sequence (batch 1, --batch and --seq unused) each preset's whole "
                             "step fits in SIZE (e.g. 80GiB), with its loss chunked, and the parts of its peak there "
                             f"(default presets: {', '.join(MAX_CONTEXT_PRESETS)})")
    parser.add_argument("--granularity", type=int_at_least(1), default=CONTEXT_GRANULARITY,
                        help="--max-context: lengths searched are multiples of this")
    parser.add_argument("--set", action="append", type=config_override, default=[], metavar="NAME=VALUE",
                        help="--max-context: set a Config field on every preset (--set mlp_chunk=4096 --set "
                             "block_checkpoint=True); repeatable")
    parser.add_argument("--measure", action="store_true",
                        help="also compile the model on this CPU (random weights) and measure the saved bytes")
    parser.add_argument("--strict", action="store_true",
                        help=f"stop at the first fallback (a pass rolled back, a region compiled unplanned) instead of "
                             f"listing it under the table: Config(strict=True), as {STRICT_ENV}=1 does")
    add_outputs(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem.whatif import measured_saved_bytes, plot, whatif

    model = get_workload(args.model).hf_config() if args.model in workload_names() else args.model
    if args.max_context is not None:
        return _run_max_context(model, args)
    if args.granularity != CONTEXT_GRANULARITY or args.set:
        console.print("[red]--granularity and --set apply to --max-context only[/red]")
        return 2
    try:
        result = whatif(model, batch=args.batch, seq=args.seq, rank=args.rank, dtype=args.dtype,
                        optimizer=args.optimizer, presets=args.presets, name=args.model, base=args.base,
                        shards=args.shards, strict=args.strict)
    except ValueError as error:
        console.print(f"[red]{escape(str(error))}; or a workload: {listed_workloads()}[/red]")
        return 2
    except FallbackError as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        return 2
    columns = ["preset", "weights", "gradients", "optimizer state", "saved activations", "total"]
    if args.measure:
        columns += ["measured saved", "predicted / measured"]
    rows = []
    for cost in result.costs:
        row = [cost.preset, *(format_bytes(b) for b in (cost.weights, cost.gradients, cost.optimizer_state,
                                                        cost.saved_activations, cost.total))]
        if args.measure:
            measured = measured_saved_bytes(model, batch=args.batch, seq=args.seq, rank=args.rank,
                                            dtype=args.dtype, preset=cost.preset)
            row += [format_bytes(measured), f"{cost.saved_activations / measured:.3f}"]
        rows.append(row)
    title = (f"{args.model}: batch {args.batch} x {args.seq}, LoRA r={args.rank}, {args.dtype}, {args.optimizer}"
             + (", NF4 base (QLoRA)" if args.base == "nf4" else "")
             + (f", per rank of FSDP2 over {args.shards}" if args.shards > 1 else ""))
    legend = ("weights: every parameter" + (" (LoRA-targeted frozen weights in NF4, 4.13 bits each)"
                                           if args.base == "nf4" else "") + "; gradients: the trainable ones, in their dtype; optimizer state: "
              f"{OPTIMIZER_STATES[args.optimizer]} fp32 tensor(s) per trainable parameter; saved activations: what "
              "one step holds from forward to backward under the preset (fxmem's analysis of a trace on fake CPU "
              "tensors, priced by the cost model)" + ("; measured: a real compiled step on this CPU" if args.measure
                                                      else ""))
    legend += "".join(f"\nsaved activations, {c.preset}: {c.how}" for c in result.costs)
    legend += _notes_text(result.notes)
    order_columns, order_rows, order_legend = _order_table(result, args.batch * args.seq)
    if result.adapter_dtype != result.dtype:
        order_legend += (f"\nPEFT keeps this {args.dtype} model's adapters in "
                         f"{str(result.adapter_dtype).removeprefix('torch.')} and casts x for them: s B A cannot be "
                         "folded into W, so the choice is among forward1 and the backward orders with a split dX")
    sections = [(title, columns, rows, legend),
                ("LoRA orders (runlora preset, FLOPs chooser)", order_columns, order_rows, order_legend)]
    if result.loss is not None:
        sections.append(_loss_section(result))
    for section in sections:
        show_table(*section)
    console.print(provenance_line(run_metadata(args)))
    write_markdown(sections, args)
    write_json(result.costs, args, model=args.model, batch=args.batch, seq=args.seq, rank=args.rank,
               dtype=args.dtype, optimizer=args.optimizer, base=args.base, shards=args.shards)
    if args.plot:
        plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _order_table(result: WhatIf, tokens: int) -> tuple[list[str], list[list[str]], str]:
    """The LoRA order table's columns, rows and legend; with LoRA on experts, how many experts share each row's
    shape and at how many tokens each."""
    columns = ["LoRA shape (in -> out, r)", "layers", "forward", "backward", "GFLOPs fwd+bwd", "default GFLOPs",
               "FLOPs saved"]
    rows = [[f"{o.shape.in_features} -> {o.shape.out_features}, r={o.shape.rank}", str(o.layers), o.choice.forward,
             o.choice.backward, f"{o.choice.cost.flops / 1e9:.1f}", f"{o.choice.default.flops / 1e9:.1f}",
             f"{o.choice.flops_saving:+.1%}"] for o in result.lora_orders]
    legend = (f"per layer at {tokens} tokens; default: autograd's order, which saves x A^T (RunLoRA's orders "
              "recompute it when they need it)")
    if any(o.experts > 1 for o in result.lora_orders):
        columns[2:2] = ["experts per layer", "tokens each"]
        rows = [[*row[:2], str(o.experts) if o.experts > 1 else "—", str(o.shape.tokens), *row[2:]]
                for row, o in zip(rows, result.lora_orders, strict=True)]
        legend = (f"per LoRA at its tokens; default: autograd's order, which saves x A^T (RunLoRA's orders "
                  "recompute it when they need it)\nexperts: PEFT adapts a mixture's stacked expert weights with one "
                  "LoRA of rank r per expert (ParamWrapper: A and B stacked to rank r x experts); each such row is "
                  f"one expert's LoRA at tokens x top-k / experts of the {tokens} tokens, routing assumed balanced "
                  "(a real router sends some experts more), and its GFLOPs are one expert's. The runlora pass "
                  "reorders the LoRA linears it finds in the graph, not the experts' LoRA: their rows are the "
                  "chooser's pick for that problem. A router's LoRA is one LoRA of rank r at every token")
    return columns, rows, legend


def _loss_section(result) -> tuple:
    """The LM loss at its peak beside each preset's total: unfused (the model returns its logits) and chunked."""
    from fxmem.measure import format_bytes

    loss = result.loss
    columns = ["preset", "total", "unfused loss", "share of peak", "chunked loss", "share of peak", "peak saved"]
    rows = []
    for cost in result.costs:
        unfused, chunked = cost.total + loss.unfused, cost.total + loss.chunked
        rows.append([cost.preset, format_bytes(cost.total), format_bytes(loss.unfused),
                     f"{loss.unfused / unfused:.0%}", format_bytes(loss.chunked), f"{loss.chunked / chunked:.0%}",
                     f"{1 - chunked / unfused:.0%}"])
    legend = (f"{loss.tokens} tokens x {loss.vocab} vocabulary. Peak: the preset's total plus the loss at its "
              "peak (cost_model/loss.py). Unfused: what the loss holds when the model returns its logits (every "
              "HF ...ForCausalLM), as torch.compile runs it and as fxmem leaves it by default: the logits, their "
              "float32 log-probabilities and gradient. Chunked: fxmem's chunk_loss "
              f"with return_logits=False, in {loss.chunks.describe(loss.tokens, loss.vocab)}, and the head "
              "input's gradient")
    return "LM loss at its peak (chunk_loss)", columns, rows, legend


def _run_max_context(model: object, args: argparse.Namespace) -> int:
    from fxmem.measure import format_bytes
    from fxmem.whatif import max_context

    if args.measure or args.plot:
        console.print("[red]--max-context predicts only: measure it with `fxmem bench context` (a workload, on this "
                      "machine); --plot draws the per-preset breakdown of a fixed length[/red]")
        return 2
    try:
        fits = max_context(model, args.max_context, rank=args.rank, dtype=args.dtype, optimizer=args.optimizer,
                           presets=args.presets or MAX_CONTEXT_PRESETS, base=args.base, shards=args.shards,
                           granularity=args.granularity, options=dict(args.set), strict=args.strict)
    except (ValueError, FallbackError) as error:
        console.print(f"[red]{escape(str(error))}[/red]")
        return 2
    columns = ["preset", "longest sequence", "weights", "optimizer state", "saved activations", "transients",
               "total", "shortest failing", "saved per token"]
    rows = [_context_row(fit) for fit in fits]
    if any(fit.host_activations for fit in fits):  # block_offload: what waits in host memory, outside the total
        columns.append("in host memory")
        rows = [row + [format_bytes(fit.host_activations) if fit.seq else "—"] for row, fit in zip(rows, fits,
                                                                                                 strict=True)]
    title = (f"{args.model}: the longest sequence in {format_bytes(args.max_context)}, batch 1, LoRA r={args.rank}, "
             f"{args.dtype}, {args.optimizer}" + (", NF4 base (QLoRA)" if args.base == "nf4" else "")
             + (f", per rank of FSDP2 over {args.shards}" if args.shards > 1 else ""))
    legend = (f"Each preset with return_logits=False (the loss chunked). Lengths are multiples of {args.granularity}, "
              "searched by "
              "tracing the model on fake tensors (fxmem.fitting). transients: beside the saved activations, the most "
              "the step's graphs hold at once, run in their own order with element-wise ops inside their readers' "
              "kernels, backward freeing each saved activation after its last reader and freed buffers kept for "
              "reuse, and the kernels between two library calls run as one call, as inductor runs them on this "
              "CPU, where whatif traces (a GPU launches each kernel apart; analysis/liveness.py): backward's "
              "gradients and intermediates at its peak, or forward's transients. Inductor places kernels otherwise: "
              "under the compressing presets it holds more at once, most without the chunk options (measured: "
              "docs/long-context.md), so a compiled step reaches a shorter length; `fxmem bench context` "
              "measures real steps.")
    if args.base == "nf4":
        legend += (" With an NF4 base, the transients include the float weights dequantized at once (one weight for "
                   "bitsandbytes' product; with mlp_chunk or linear_chunk, a module's projections together, "
                   "fxmem.whatif.dequantized_base_bytes).")
    legend += "".join(f"\n{fit.preset}: {fit.how}" for fit in fits if fit.how)
    legend += _notes_text([(fit.preset, note) for fit in fits for note in fit.notes])
    show_table(title, columns, rows, legend)
    console.print(provenance_line(run_metadata(args)))
    write_markdown([(title, columns, rows, legend)], args)
    write_json(fits, args, model=args.model, memory=args.max_context, rank=args.rank, dtype=args.dtype,
               optimizer=args.optimizer, base=args.base, shards=args.shards, granularity=args.granularity)
    return 0


def _notes_text(notes: Sequence[tuple[str, TraceNote]]) -> str:
    """The legend's lines on what fxmem said while tracing: a fallback changes what a preset's figures count."""
    if not notes:
        return ""
    return ("\nnotes, from fxmem's report on the traces (a fallback: the figures are of what fxmem did instead; "
            f"--strict or {STRICT_ENV}=1 stops there):"
            + "".join(f"\n  {preset}: {escape(note.describe())}" for preset, note in notes))


def _context_row(fit: ContextFit) -> list[str]:
    from fxmem.measure import format_bytes

    if not fit.seq:
        return [fit.preset, "none fits", *["—"] * 7]
    return [fit.preset, f"{fit.seq:,}", *(format_bytes(b) for b in (fit.weights, fit.optimizer_state,
                                                                    fit.saved_activations, fit.transient, fit.total)),
            f"{fit.shortest_failing:,}" if fit.shortest_failing else "—", format_bytes(fit.saved_activations / fit.seq)]
