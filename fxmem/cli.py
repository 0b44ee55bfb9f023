"""The `fxmem` command: inspect | whatif | bench | bench-lora | finetune | ablate | hift | loqt."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import pathlib
import shlex
import sys
import warnings
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fxmem.bench import METHODS
from fxmem.config import BITS_CHOICES, PRESETS, Config
from fxmem.cost_model.whatif import DTYPES, NAMED_SHAPES, OPTIMIZER_STATES
from fxmem.inspection import inspect as inspect_model
from fxmem.measure import format_bytes
from fxmem.train.hift import ORDERS
from fxmem.train.hift_bench import COMPILE_CHOICES, SCOPES
from fxmem.workloads import WORKLOADS, get_workload

console = Console()


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}; got {value}")
        return value
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fxmem", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="every tensor a model saves for backward, its role and plan")
    inspect.add_argument("model", help=f"a workload ({', '.join(WORKLOADS)}) or a HuggingFace config.json "
                                       "(file or directory)")
    inspect.add_argument("--batch", type=int, help="batch size (default: the workload's, else 4)")
    inspect.add_argument("--seq", type=int, help="sequence length (default: the workload's, else 512)")
    inspect.add_argument("--lora-rank", type=_int_at_least(0), default=16, help="LoRA rank; 0 for full fine-tuning")
    inspect.add_argument("--preset", default="exact", choices=list(PRESETS))
    inspect.add_argument("--memory-budget", type=float, metavar="FRACTION",
                         help="cap saved activations at this fraction of what the model saves (see README)")
    inspect.add_argument("--device", default="cpu")
    inspect.add_argument("--json", type=pathlib.Path, metavar="PATH", help="also write the report as JSON")
    inspect.add_argument("--all", action="store_true", help="also list parameters and inputs (they free nothing)")

    whatif = commands.add_parser("whatif", help="memory per preset and LoRA orders of a model, before running it "
                                                "(no GPU, no weights: traced on fake tensors)")
    whatif.add_argument("model", help=f"a named shape ({', '.join(NAMED_SHAPES)}), a workload "
                                      f"({', '.join(WORKLOADS)}) or a HuggingFace config.json")
    whatif.add_argument("--batch", type=_int_at_least(1), default=4)
    whatif.add_argument("--seq", type=_int_at_least(1), default=512)
    whatif.add_argument("--rank", type=_int_at_least(1), default=16, help="LoRA rank")
    whatif.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    whatif.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATES))
    whatif.add_argument("--presets", nargs="+", choices=list(PRESETS), help="default: every preset")
    whatif.add_argument("--plot", type=pathlib.Path, metavar="PNG", help="draw the breakdown as stacked bars")
    whatif.add_argument("--measure", action="store_true",
                        help="also compile the model on this CPU (random weights) and measure the saved bytes")
    whatif.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the tables as markdown")

    bench_lora = commands.add_parser("bench-lora", help="one LoRA layer's fwd+bwd time: RunLoRA's orders vs PEFT")
    bench_lora.add_argument("--shapes", nargs="+", required=True, metavar="N,IN,OUT,R",
                            help="tokens (batch x seq), in and out features, rank; e.g. 2048,1024,2752,16")
    bench_lora.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    bench_lora.add_argument("--steps", type=_int_at_least(1), default=10, help="timed steps (median reported)")
    bench_lora.add_argument("--device", default="cpu")
    bench_lora.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    bench = commands.add_parser("bench", help="fxmem vs the four baselines on the benchmark workloads")
    bench.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                       help="default: llama-tiny and llama-small, plus llama-7b-shape on a GPU")
    bench.add_argument("--preset", default="exact", choices=list(PRESETS))
    bench.add_argument("--steps", type=_int_at_least(1), default=5, help="timed steps per method (median reported)")
    bench.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                       help="default: fxmem and all four baselines")
    bench.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    bench.add_argument("--json", type=pathlib.Path, metavar="PATH")
    bench.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    finetune = commands.add_parser("finetune", help="a short LoRA fine-tune with and without fxmem, side by side")
    finetune.add_argument("--workload", default="llama-tiny", choices=list(WORKLOADS))
    finetune.add_argument("--steps", type=_int_at_least(3), default=40,
                          help="optimizer steps per method (>= 3: the first measures saved bytes, the second peak)")
    finetune.add_argument("--lr", type=float, default=1e-3)
    finetune.add_argument("--preset", default="exact", choices=list(PRESETS))
    finetune.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")

    ablate = commands.add_parser(
        "ablate", help="accuracy of the lossy presets: HyC-LoRA's bits x intra/inter-operator x outlier channels, "
                       "or LoRAct's rank ratios x pre-norm sharing")
    ablate.add_argument("--workload", default="llama-tiny", choices=list(WORKLOADS))
    ablate.add_argument("--steps", type=_int_at_least(3), default=200)
    ablate.add_argument("--technique", choices=["hyclora", "loract"], default="hyclora",
                        help="hyclora: the --bits settings; loract: the --ratios settings")
    ablate.add_argument("--bits", type=int, nargs="+", choices=BITS_CHOICES,
                        help="hyclora: bit widths (default 4 2)")
    ablate.add_argument("--ratios", nargs="+", type=_lowrank_rank,
                        help="loract: lowrank values, ratios in (0, 1) of the last dimension or integer ranks "
                             "(default 0.5 0.25 0.125 0.0625)")
    ablate.add_argument("--settings", nargs="+", metavar="NAME",
                        help="run only these fxmem settings (names as the table prints them), beside the baselines")
    ablate.add_argument("--lr", type=float, default=1e-3)
    ablate.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ablate.add_argument("--json", type=pathlib.Path, metavar="PATH")
    ablate.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    hift = commands.add_parser("hift", help="HiFT (one layer group per step) against plain full fine-tuning")
    hift.add_argument("--workload", default="minilm-real", choices=list(WORKLOADS))
    hift.add_argument("--cycles", type=_int_at_least(2), default=20,
                      help="full HiFT cycles (k steps each; plain fine-tuning takes as many steps)")
    hift.add_argument("--orders", nargs="+", choices=list(ORDERS), default=list(ORDERS))
    hift.add_argument("--layers-per-group", type=_int_at_least(1), default=1)
    hift.add_argument("--lr", type=float, default=2e-5, help="AdamW peak LR, cosine decay over the run")
    hift.add_argument("--compile", default="none", choices=list(COMPILE_CHOICES),
                      help="torch.compile backend (plain: the whole model; HiFT: see --scope)")
    hift.add_argument("--scope", default="blocks", choices=list(SCOPES),
                      help="what HiFT compiles: each block (hift.compile) or the whole model")
    hift.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    hift.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    loqt = commands.add_parser("loqt", help="LoQT (quantized low-rank training): pretraining ablation, "
                                            "fine-tuning vs LoRA, memory accounting")
    loqt_commands = loqt.add_subparsers(dest="experiment", required=True)
    pretrain = loqt_commands.add_parser("pretrain", help="from random init: full, LoQT-nq, LoQT, no compensation, "
                                                         "fixed interval, on the same batches")
    pretrain.add_argument("--workload", default="llama-tiny", choices=[n for n, w in WORKLOADS.items()
                                                                       if w.family == "llama"])
    pretrain.add_argument("--steps", type=_int_at_least(1), default=500)
    pretrain.add_argument("--rank", type=_int_at_least(1), default=64, help="the paper's ratio: hidden / 4")
    pretrain.add_argument("--scale", type=float, default=0.5, help="s in W + s P B")
    pretrain.add_argument("--first-interval", type=_int_at_least(1), default=10,
                          help="optimizer steps to the first merge (the paper: 100 of 10k steps)")
    pretrain.add_argument("--lr", type=float, default=5e-4, help="AdamW lr of full training and of the parameters "
                                                                  "LoQT does not convert")
    pretrain.add_argument("--loqt-lr", type=float, default=1e-2, help="AdamW lr of B (the paper: 1e-2)")
    finetune_loqt = loqt_commands.add_parser("finetune", help="a pretrained workload: LoRA vs LoQT, LoQT-nq, "
                                                              "LoQT at twice the rank")
    finetune_loqt.add_argument("--workload", default="minilm-real", choices=list(WORKLOADS))
    finetune_loqt.add_argument("--steps", type=_int_at_least(1), default=80)
    finetune_loqt.add_argument("--rank", type=_int_at_least(1), default=16)
    finetune_loqt.add_argument("--scale", type=float, default=2.0, help="s in W + s P B (the paper's GLUE: 2)")
    finetune_loqt.add_argument("--first-interval", type=_int_at_least(1), default=20)
    finetune_loqt.add_argument("--lr", type=float, default=1e-3, help="AdamW lr of LoRA")
    finetune_loqt.add_argument("--loqt-lr", type=float, default=3e-4, help="AdamW lr of B")
    for experiment in (pretrain, finetune_loqt):
        experiment.add_argument("--eval-batches", type=_int_at_least(1), default=8,
                                help="held-out batches (after the training ones) the loss is scored on")
        experiment.add_argument("--seed", type=int, default=0, help="seeds the initial weights (random-init models)")
    memory = loqt_commands.add_parser("memory", help="bytes per weight, trainable parameters, optimizer state: "
                                                     "full vs LoRA vs LoQT on the real model")
    memory.add_argument("--workload", default="llama-small", choices=list(WORKLOADS))
    memory.add_argument("--lora-rank", type=_int_at_least(1), default=16)
    memory.add_argument("--rank", type=_int_at_least(1), default=16, help="LoQT's rank when only B trains")
    memory.add_argument("--pretrain-rank", type=_int_at_least(1), default=256,
                        help="LoQT's rank when pretraining (the paper's ratio: hidden / 4)")
    for experiment in (pretrain, finetune_loqt, memory):
        experiment.add_argument("--json", type=pathlib.Path, metavar="PATH")
        experiment.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    lowrank_error = commands.add_parser("lowrank-error", help="low-rank reconstruction error and time at equal rank: "
                                        "LoRAct's sampling vs randomized SVD vs truncated SVD")
    lowrank_error.add_argument("--rank", type=_lowrank_rank, default=0.125,
                               help="a ratio in (0, 1) of the last dimension or an integer rank (default 0.125)")
    lowrank_error.add_argument("--niter", type=_int_at_least(0), default=1, help="power iterations (default 1)")
    lowrank_error.add_argument("--repeats", type=_int_at_least(1), default=3, help="draws per method and matrix")
    lowrank_error.add_argument("--sources", nargs="+", choices=["synthetic", "llama-tiny"],
                               default=["synthetic", "llama-tiny"],
                               help="low-rank-plus-noise matrices and/or llama-tiny's saved activations")
    lowrank_error.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    lowrank_saved = commands.add_parser("lowrank-saved", help="LoRAct's saved-activation bytes and gradient fidelity "
                                        "per rank ratio, vs eager PEFT LoRA (one batch)")
    lowrank_saved.add_argument("--workload", choices=list(WORKLOADS), default="llama-tiny")
    lowrank_saved.add_argument("--ratios", nargs="+", type=_lowrank_rank, default=[0.5, 0.25, 0.125, 0.0625],
                               help="lowrank values: ratios in (0, 1) of the last dimension or integer ranks")
    lowrank_saved.add_argument("--lowering", choices=["inductor", "eager"], default="inductor",
                               help="eager: run the rewritten aten graphs without code generation (same bytes)")
    lowrank_saved.add_argument("--markdown", type=pathlib.Path, metavar="PATH", help="write the table as markdown")

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.command_line = "fxmem " + " ".join(shlex.quote(a) for a in argv)
    if not console.is_terminal:  # piped or captured: wide rows instead of columns wrapped at 80
        console.width = max(console.width, 200)
    # transformers warns about its own deprecations on every traced forward; they are not the user's concern here.
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    # peft imports bitsandbytes, which warns that an optional CPU gemv kernel package is absent; fxmem never uses it.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # bench and finetune compile with caches off on purpose; torch says so once per compile.
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    return {"inspect": _inspect, "whatif": _whatif, "bench-lora": _bench_lora, "bench": _bench,
            "finetune": _finetune, "ablate": _ablate, "hift": _hift, "loqt": _loqt,
            "lowrank-error": _lowrank_error, "lowrank-saved": _lowrank_saved}[args.command](args)


def _lowrank_rank(text: str) -> float | int:
    from fxmem.config import check_lowrank
    try:
        value = int(text) if text.isdigit() else float(text)
        check_lowrank(value, allow_none=False)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return value


LOWRANK_ERROR_COLUMNS = ("matrix", "shape", "rank", "method", "relative error", "vs truncated SVD", "time")


def _lowrank_error(args: argparse.Namespace) -> int:
    from fxmem.bench import machine_description
    from fxmem.lowrank_error import measure, saved_activations, synthetic_matrices
    matrices = []
    with console.status("building matrices"):
        if "synthetic" in args.sources:
            matrices += synthetic_matrices()
        if "llama-tiny" in args.sources:
            matrices += saved_activations("llama-tiny")
    with console.status("decomposing"):
        results = measure(matrices, args.rank, niter=args.niter, repeats=args.repeats)
    rows = [[r.matrix, "x".join(map(str, r.shape)), str(r.rank), r.method, f"{r.relative_error:.4f}",
             f"{r.vs_optimal:.3f}x", f"{r.seconds * 1000:.1f} ms"] for r in results]
    legend = (f"{datetime.date.today().isoformat()}, {machine_description('cpu')}, "
              f"{torch.get_num_threads()} thread(s). relative error: ||A - UV||_F / ||A||_F, mean of {args.repeats} "
              f"draws; time: median of the draws, decomposition plus reconstruction.")
    _print_table("fxmem lowrank-error", LOWRANK_ERROR_COLUMNS, rows, legend, args)
    return 0


LOWRANK_SAVED_COLUMNS = ("lowrank", "saved activations", "planned", "reduction vs eager", "norm inputs shared",
                         "min grad cos", "median grad rel err")


def _lowrank_saved(args: argparse.Namespace) -> int:
    from fxmem.bench import machine_description
    from fxmem.lowrank_saved import measure_ratios
    workload = get_workload(args.workload)
    with console.status(f"{workload.name}: eager PEFT, then fxmem at {len(args.ratios)} ratio(s)"):
        results = measure_ratios(workload, args.ratios, lowering=args.lowering)
    eager = results[0].saved_bytes
    rows = [[r.setting, format_bytes(r.saved_bytes),
             "" if r.planned_bytes is None else format_bytes(r.planned_bytes), f"{eager / r.saved_bytes:.2f}x",
             str(r.prenorm_shared), "" if r.fidelity is None else f"{r.fidelity.min_cosine:.4f}",
             "" if r.fidelity is None else f"{r.fidelity.median_relative_error:.4f}"] for r in results]
    legend = (f"{datetime.date.today().isoformat()}, {machine_description('cpu')}, "
              f"{torch.get_num_threads()} thread(s). {workload.name}: {workload.description}, batch "
              f"{workload.batch} x {workload.seq}, LoRA r=16 on every linear, seeded random weights, one batch of "
              f"real text. saved: measured (unique storages autograd holds, parameters and inputs excluded); "
              f"planned: the cost model's; gradients vs eager PEFT's on the same batch and weights.")
    _print_table("fxmem lowrank-saved", LOWRANK_SAVED_COLUMNS, rows, legend, args)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.model in WORKLOADS:
        workload = get_workload(args.model)
        workload = dataclasses.replace(workload, batch=args.batch or workload.batch, seq=args.seq or workload.seq)
        setup = workload.build(device=args.device, lora_rank=args.lora_rank)
        model, batch = setup.model, next(setup.batches)
    else:
        model, batch = _model_from_config(pathlib.Path(args.model), args.batch or 4, args.seq or 512,
                                          args.lora_rank, torch.device(args.device))
    try:
        config = Config.from_preset(args.preset, memory_budget=args.memory_budget)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    report = inspect_model(model, config=config, **batch)
    console.print(*report.renderables(include_all=args.all))
    if args.json:
        args.json.write_text(report.to_json())
        console.print(f"wrote {args.json}")
    return 0


def _whatif(args: argparse.Namespace) -> int:
    from fxmem.cost_model.whatif import measured_saved_bytes, plot, whatif
    try:
        result = whatif(args.model, batch=args.batch, seq=args.seq, rank=args.rank, dtype=args.dtype,
                        optimizer=args.optimizer, presets=args.presets)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    columns = ["preset", "weights", "gradients", "optimizer state", "saved activations", "total"]
    if args.measure:
        columns += ["measured saved", "predicted / measured"]
    rows = []
    for cost in result.costs:
        row = [cost.preset, *(format_bytes(b) for b in (cost.weights, cost.gradients, cost.optimizer_state,
                                                        cost.saved_activations, cost.total))]
        if args.measure:
            measured = measured_saved_bytes(args.model, batch=args.batch, seq=args.seq, rank=args.rank,
                                            dtype=args.dtype, preset=cost.preset)
            row += [format_bytes(measured), f"{cost.saved_activations / measured:.3f}"]
        rows.append(row)
    title = (f"{args.model}: batch {args.batch} x {args.seq}, LoRA r={args.rank}, {args.dtype}, {args.optimizer}")
    legend = ("weights: every parameter; gradients: the trainable ones, in their dtype; optimizer state: "
              f"{OPTIMIZER_STATES[args.optimizer]} fp32 tensor(s) per trainable parameter; saved activations: what "
              "one step holds from forward to backward under the preset (fxmem's analysis of a trace on fake CPU "
              "tensors, priced by the cost model)" + ("; measured: a real compiled step on this CPU" if args.measure
                                                      else ""))
    legend += "".join(f"\nsaved activations, {c.preset}: {c.how}" for c in result.costs)
    markdown = args.markdown
    args.markdown = None  # _print_table writes one table; both go to the file below
    _print_table(title, columns, rows, legend, args)
    order_columns = ["LoRA shape (in -> out, r)", "layers", "forward", "backward", "GFLOPs fwd+bwd",
                     "default GFLOPs", "FLOPs saved"]
    order_rows = [[f"{s.in_features} -> {s.out_features}, r={s.rank}", str(count), c.forward, c.backward,
                   f"{c.cost.flops / 1e9:.1f}", f"{c.default.flops / 1e9:.1f}", f"{c.flops_saving:+.1%}"]
                  for s, count, c in result.lora_orders]
    order_legend = (f"per layer at {args.batch * args.seq} tokens; default: autograd's order, which saves x A^T "
                    "(RunLoRA's orders recompute it when they need it)")
    if result.adapter_dtype != result.dtype:
        order_legend += (f"\nPEFT keeps this {args.dtype} model's adapters in "
                         f"{str(result.adapter_dtype).removeprefix('torch.')} and casts x for them: s B A cannot be "
                         "folded into W, so the choice is among forward1 and the backward orders with a split dX")
    _print_table("LoRA orders (runlora preset, FLOPs chooser)", order_columns, order_rows, order_legend, args)
    if markdown:
        lines = [f"`{args.command_line}`", ""]
        for table_title, table_columns, table_rows, table_legend in ((title, columns, rows, legend), (
                "LoRA orders", order_columns, order_rows, order_legend)):
            lines += [table_title, "", *_markdown_table(table_columns, table_rows, table_legend)]
        markdown.write_text("\n".join(lines))
        console.print(f"wrote {markdown}")
    if args.plot:
        plot(result, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _bench_lora(args: argparse.Namespace) -> int:
    from fxmem.bench import machine_description
    from fxmem.cost_model.lora_bench import time_lora_layer
    from fxmem.cost_model.lora_orders import LoraShape
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
    legend = (f"{datetime.date.today().isoformat()}, {machine_description(args.device)}, {args.dtype}. Median of "
              f"{args.steps} fwd+bwd steps, all timed back to back in each round; speed-up: median of the "
              "rounds' PEFT / runlora ratios, middle half: their quartiles; PEFT: its eager LoRA Linear (saves "
              "x A^T); runlora: fxmem.kernels.runlora_linear in the FLOPs chooser's orders, its products with W "
              "(forward/backward) in the library measured faster on this device; orders only: the speed-up with "
              "aten's products; FLOPs saved: vs autograd's order")
    _print_table("one LoRA layer, forward + backward", ["tokens, in -> out, rank", "orders", "W products",
                                                         "FLOPs saved", "PEFT", "runlora", "speed-up", "middle half",
                                                         "orders only"], rows, legend, args)
    return 0


def _model_from_config(path: pathlib.Path, batch: int, seq: int, lora_rank: int, device: torch.device
                       ) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Random-weight model of a HuggingFace config, LoRA on all linears, and a random token batch."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    if not path.exists():
        raise SystemExit(f"{path}: neither a workload ({', '.join(WORKLOADS)}) nor an existing config.json")
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    causal = any(a.endswith("ForCausalLM") for a in (config.architectures or []))
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if causal else AutoModel).from_config(config).to(device)
    if lora_rank:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora_rank, lora_alpha=lora_rank, target_modules="all-linear"))
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    return model, ({"input_ids": ids, "labels": ids} if causal else {"input_ids": ids})


def _bench(args: argparse.Namespace) -> int:
    from fxmem.bench import METHOD_DESCRIPTIONS, bench_metadata, run_workload
    device = torch.device(args.device)
    names = args.workloads or ["llama-tiny", "llama-small"] + (["llama-7b-shape"] if device.type == "cuda" else [])
    metadata = bench_metadata(args.command_line, device, args.preset)
    results = []
    with console.status("benchmarking") as status:
        for name in names:
            results += run_workload(get_workload(name), preset=args.preset, device=device, steps=args.steps,
                                    methods=args.methods, progress=lambda message: status.update(message))
    rows = _bench_rows(results)
    console.print(_bench_table(rows))
    console.print(f"{metadata['date']}, {metadata['machine']}; preset {args.preset}; {args.steps} timed steps")
    for name, meaning in {**METHOD_DESCRIPTIONS, **BENCH_LEGEND}.items():
        console.print(f"  {name}: {meaning}")
    if args.json:
        args.json.write_text(json.dumps({**metadata, "results": [r.to_dict() for r in results]}, indent=2))
        console.print(f"wrote {args.json}")
    if args.markdown:
        args.markdown.write_text(_markdown(rows, metadata))
        console.print(f"wrote {args.markdown}")
    return 0


BENCH_COLUMNS = ("workload", "method", "saved activations", "reduction vs eager", "step peak", "static",
                 "peak incl. static", "step time", "vs eager", "vs compile", "min grad cos", "median grad rel err",
                 "compile s")
BENCH_LEGEND = {
    "step peak": "a full training step's peak allocation above what was allocated when it began "
                 "(CPU: profiler allocation events; CUDA: allocator statistics)",
    "static": "weights, buffers and optimizer state",
    "step time": "median of the timed steps, methods timed interleaved in one process",
    "min grad cos / median grad rel err": "trainable gradients vs eager's on the same batch and weights",
    "compile s": "first step minus a warm step, every method compiled with inductor's caches off",
}


def _bench_rows(results: list) -> list[list[str]]:
    by_key = {(r.workload, r.method): r for r in results}
    rows = []
    for r in results:
        eager, compiled = by_key.get((r.workload, "eager")), by_key.get((r.workload, "compile"))
        rows.append([
            r.workload, r.method if r.budget is None else f"{r.method} ({r.budget:.3f})", format_bytes(r.saved_bytes),
            f"{eager.saved_bytes / r.saved_bytes:.2f}x" if eager and r.saved_bytes else "—",
            format_bytes(r.peak_bytes), format_bytes(r.static_bytes), format_bytes(r.peak_bytes + r.static_bytes),
            f"{r.step_seconds:.3f} s",
            f"{r.step_seconds / eager.step_seconds:.2f}" if eager else "—",
            f"{r.step_seconds / compiled.step_seconds:.2f}" if compiled else "—",
            f"{r.fidelity.min_cosine:.6f}" if r.fidelity else "(reference)",
            f"{r.fidelity.median_relative_error:.1e}" if r.fidelity else "—",
            f"{r.compile_seconds:.1f}" if r.compile_seconds else "—"])
    return rows


def _bench_table(rows: list[list[str]]) -> Table:
    table = Table(title="fxmem bench", title_justify="left")
    for column in BENCH_COLUMNS:
        table.add_column(column, justify="left" if column in ("workload", "method") else "right")
    for row in rows:
        table.add_row(*row)
    return table


def _markdown(rows: list[list[str]], metadata: dict) -> str:
    legend = "\n".join(f"- {name}: {meaning}" for name, meaning in BENCH_LEGEND.items())
    lines = [f"Date: {metadata['date']}. Machine: {metadata['machine']}. Preset: `{metadata['preset']}`.",
             f"Command: `{metadata['command']}`", "", *_markdown_table(BENCH_COLUMNS, rows, legend)]
    return "\n".join(lines)


def _finetune(args: argparse.Namespace) -> int:
    from fxmem.finetune import FINETUNE_METHODS, finetune
    workload = get_workload(args.workload)
    console.print(f"LoRA fine-tune of {workload.name} ({workload.description}), batch {workload.batch} x "
                  f"{workload.seq} tokens of Python standard-library source, {args.steps} steps, AdamW lr {args.lr}")
    columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        tasks = {m: progress.add_task(f"fxmem ({args.preset})" if m == "fxmem" else m, total=args.steps, loss="—")
                 for m in FINETUNE_METHODS}
        results = finetune(workload, FINETUNE_METHODS, steps=args.steps, lr=args.lr, preset=args.preset,
                           device=args.device, on_step=lambda method, step, loss: progress.update(
                               tasks[method], completed=step, loss=f"{loss:.4f}"))
    eager = results[0]
    table = Table(title=f"{workload.name}: {args.steps} steps", title_justify="left")
    for column in ("method", "saved activations", "vs eager", "step peak", "step time", "vs eager", "first step",
                   "final loss"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for r in results:
        table.add_row(f"fxmem ({args.preset})" if r.method == "fxmem" else r.method, format_bytes(r.saved_bytes),
                      f"{eager.saved_bytes / r.saved_bytes:.2f}x smaller" if r is not eager else "—",
                      format_bytes(r.peak_bytes), f"{r.step_seconds * 1000:.0f} ms",
                      f"{r.step_seconds / eager.step_seconds:.2f}x" if r is not eager else "—",
                      f"{r.first_step_seconds:.1f} s", f"{r.final_loss:.4f}")
    console.print(table)
    console.print("saved activations: bytes held from forward to backward, parameters and inputs excluded. "
                  f"step peak: {BENCH_LEGEND['step peak']}. first step includes compilation (caches off). "
                  "final loss: mean of the last 5 steps.")
    return 0


ABLATE_COLUMNS = ("setting", "saved activations", "vs eager", "min grad cosine", "median grad error",
                  "final loss", "vs compile", "step time vs compile")


def _ablate(args: argparse.Namespace) -> int:
    from fxmem.ablation import DEFAULT_BITS, DEFAULT_RATIOS, ablate, hyclora_settings, loract_settings, select_settings
    workload = get_workload(args.workload)
    misplaced = "--ratios" if args.technique == "hyclora" and args.ratios else \
        "--bits" if args.technique == "loract" and args.bits else None
    if misplaced:
        console.print(f"[red]{misplaced} does not apply to --technique {args.technique}[/red]")
        return 2
    try:
        if args.technique == "hyclora":
            settings = hyclora_settings(args.bits or DEFAULT_BITS)
        else:
            settings = loract_settings(args.ratios or DEFAULT_RATIOS)
        if args.settings:
            settings = select_settings(settings, args.settings)
    except ValueError as error:
        console.print(f"[red]{error}[/red]")
        return 2
    console.print(f"{workload.name} ({workload.description}): {args.steps} LoRA steps on Python standard-library "
                  f"source, AdamW lr {args.lr}, {len(settings)} settings round-robin")
    with Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=console) as progress:
        tasks = {s.name: progress.add_task(s.name, total=args.steps, loss="—") for s in settings}
        results = ablate(workload, settings, steps=args.steps, lr=args.lr, device=args.device,
                         on_step=lambda name, step, loss: progress.update(tasks[name], completed=step,
                                                                          loss=f"{loss:.4f}"))
    eager, compiled = results[0], results[1]
    rows = []
    for r in results:
        rows.append([
            r.setting, format_bytes(r.saved_bytes), f"{eager.saved_bytes / r.saved_bytes:.2f}x",
            "—" if r.min_cosine is None else f"{r.min_cosine:.4f}",
            "—" if r.median_error is None else f"{r.median_error:.4f}",
            f"{r.final_loss:.4f}", f"{(r.final_loss - compiled.final_loss) / compiled.final_loss:+.2%}",
            f"{r.step_seconds / compiled.step_seconds:.2f}x"])
    legend = ("grad cosine / error: every trainable gradient on a fixed batch vs the eager model's at the same "
              "weights, probed after calibration, mid-way and at the end (minimum cosine, median relative L2 "
              "error). final loss: mean of the last 5 steps; vs compile: relative to torch.compile's.")
    _print_table(f"{workload.name}: {args.steps} steps", ABLATE_COLUMNS, rows, legend, args)
    _write_results_json(results, args)
    return 0


def _loqt(args: argparse.Namespace) -> int:
    from fxmem.bench import machine_description
    from fxmem.train import loqt_bench
    workload = get_workload(args.workload)
    when = f"{datetime.date.today().isoformat()}, {machine_description('cpu')}. "
    if args.experiment == "memory":
        settings = loqt_bench.memory_settings(workload, lora_rank=args.lora_rank, loqt_rank=args.rank,
                                              pretrain_rank=args.pretrain_rank)
        results = []
        with console.status("measuring") as status:
            for setting, adapter_only in settings:
                status.update(f"{workload.name}: {setting.name}")
                results.append(loqt_bench.memory_row(workload, setting, adapter_only=adapter_only))
        title = f"{workload.name}: the targeted linears' weights, trainable parameters, AdamW state"
        columns, rows = loqt_bench.MEMORY_COLUMNS, loqt_bench.memory_rows(results)
        legend = ("W bits/param: stored bits of the targeted linears' weights per parameter (NF4: 4-bit codes, "
                  "8-bit block scales, their float32 scales). W + P + adapter: everything those linears store "
                  "(LoRA's A and B, LoQT's P and B), per parameter of W. optimizer state: AdamW's, measured.")
    else:
        pretraining = args.experiment == "pretrain"
        if pretraining:
            settings = loqt_bench.pretrain_settings(args.rank, scale=args.scale, first_interval=args.first_interval)
        else:
            settings = loqt_bench.finetune_settings(workload, args.rank, scale=args.scale,
                                                    first_interval=args.first_interval)
        console.print(f"{workload.name} ({workload.description}), {args.steps} AdamW steps each, "
                      f"lr {args.lr}, B's lr {args.loqt_lr}, rank {args.rank}, s {args.scale}, first merge after "
                      f"{args.first_interval} steps, seed {args.seed}")
        progress_columns = (TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
        with Progress(*progress_columns, console=console) as progress:
            tasks = {s.name: progress.add_task(s.name, total=args.steps, loss="—") for s in settings}
            results = [loqt_bench.train(workload, s, steps=args.steps, lr=args.lr, loqt_lr=args.loqt_lr,
                                        eval_batches=args.eval_batches, adapter_only=not pretraining, seed=args.seed,
                                        on_step=lambda name, step, loss: progress.update(
                                            tasks[name], completed=step, loss=f"{loss:.4f}"))
                       for s in settings]
        reference = results[0]
        title = f"{workload.name}: {args.experiment}, {args.steps} steps"
        columns = [c.format(reference="full" if pretraining else "LoRA") for c in loqt_bench.RUN_COLUMNS]
        rows = loqt_bench.run_rows(results, reference)
        legend = (f"eval loss: mean over {args.eval_batches} held-out batches after the last step; at start: "
                  "after conversion, before training. merges: LoQT's, after the first projection. W bits/param: "
                  "stored bits of the converted (or targeted) linears' weights per parameter.")
    _print_table(title, columns, rows, when + legend, args)
    _write_results_json(results, args)
    return 0


HIFT_COLUMNS = ("run", "k", "steps", "eval loss", "vs full, same batches", "vs full, same updates", "gradients mean / max", "optimizer state on device mean / max",
                "offloaded max", "step peak", "step time", "vs full", "graphs", "eager fallbacks")


def _hift(args: argparse.Namespace) -> int:
    from fxmem.bench import machine_description
    from fxmem.train.hift_bench import EVAL_BATCHES, compare_hift
    workload = get_workload(args.workload)
    console.print(f"full fine-tuning of {workload.name} ({workload.description}), batch {workload.batch} x "
                  f"{workload.seq}, AdamW lr {args.lr} cosine-decayed, {args.cycles} HiFT cycles; "
                  f"compile: {args.compile}" + (f" ({args.scope})" if args.compile != "none" else ""))
    with console.status("training") as status:
        results = compare_hift(workload, args.orders, cycles=args.cycles, lr=args.lr,
                               layers_per_group=args.layers_per_group, compile_backend=args.compile,
                               scope=args.scope, device=args.device,
                               on_step=lambda name, step: status.update(f"{name}: step {step}"))
    same_batches, same_updates, k = results[0], results[1], results[2].groups
    rows = [[r.name, str(r.groups), str(r.steps), f"{r.eval_loss:.4f}",
             f"{(r.eval_loss - same_batches.eval_loss) / same_batches.eval_loss:+.2%}",
             f"{(r.eval_loss - same_updates.eval_loss) / same_updates.eval_loss:+.2%}",
             _mean_max(r.gradient_bytes), _mean_max(r.device_state_bytes),
             format_bytes(max(r.offloaded_state_bytes)), format_bytes(r.step_peak_bytes),
             f"{r.step_seconds * 1000:.0f} ms", f"{r.step_seconds / same_batches.step_seconds:.2f}x", str(r.graphs),
             str(r.eager_fallbacks)] for r in results]
    legend = (f"{datetime.date.today().isoformat()}, {machine_description(args.device)}. eval loss: mean over "
              f"{EVAL_BATCHES} held-out batches after training. full, same batches: {args.cycles * k} steps on the "
              f"batches HiFT saw; full, same updates: {args.cycles} steps, each parameter updated as often as under "
              "HiFT. gradients / optimizer state: what each step holds, from the live tensors, mean and largest over "
              "the steps (on a CPU run 'offloaded' is an accounting category: the device is the CPU). step peak: "
              + BENCH_LEGEND["step peak"] + ", largest over the last cycle. graphs: dynamo graphs compiled during "
              "the run.")
    _print_table(f"{workload.name}: {args.cycles} cycles of k={k} steps", HIFT_COLUMNS, rows, legend, args)
    return 0


def _print_table(title: str, columns: Sequence[str], rows: list[list[str]], legend: str,
                 args: argparse.Namespace) -> None:
    """Print a table (first column left-aligned) and its legend; with --markdown, also write them as markdown."""
    table = Table(title=title, title_justify="left")
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(legend)
    if args.markdown:
        args.markdown.write_text("\n".join([f"`{args.command_line}`", "", *_markdown_table(columns, rows, legend)]))


def _write_results_json(results: Sequence, args: argparse.Namespace) -> None:
    """With --json, write the command line and every result's ``to_dict()``."""
    if args.json:
        args.json.write_text(json.dumps({"command": args.command_line, "results": [r.to_dict() for r in results]},
                                        indent=2))


def _markdown_table(columns: Sequence[str], rows: list[list[str]], legend: str) -> list[str]:
    """The lines of a markdown table and its legend, ending with a blank line."""
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(row) + " |" for row in rows] + ["", legend, ""])


def _mean_max(values: list[int]) -> str:
    return f"{format_bytes(sum(values) / len(values))} / {format_bytes(max(values))}"


if __name__ == "__main__":
    sys.exit(main())
