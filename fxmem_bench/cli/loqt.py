"""`fxmem bench loqt pretrain | finetune | memory`: LoQT against full training and LoRA, and its memory."""

from __future__ import annotations

import argparse

from fxmem.cli.common import add_outputs, console, int_at_least, print_table, progress_bars, write_json
from fxmem_bench.cli.workloads import get_workload, workload_names

NAME = "loqt"


def add_parser(experiments: argparse._SubParsersAction) -> None:
    parser = experiments.add_parser(NAME, help="LoQT (quantized low-rank training): pretraining ablation, "
                                               "fine-tuning vs LoRA, memory accounting")
    kinds = parser.add_subparsers(dest="loqt_experiment", required=True)
    pretrain = kinds.add_parser("pretrain", help="from random init: full, LoQT-nq, LoQT, no compensation, "
                                                 "fixed interval, on the same batches")
    pretrain.add_argument("--workload", default="llama-tiny", choices=workload_names("llama"))
    pretrain.add_argument("--steps", type=int_at_least(1), default=500)
    pretrain.add_argument("--rank", type=int_at_least(1), default=64, help="the paper's ratio: hidden / 4")
    pretrain.add_argument("--scale", type=float, default=0.5, help="s in W + s P B")
    pretrain.add_argument("--first-interval", type=int_at_least(1), default=10,
                          help="optimizer steps to the first merge (the paper: 100 of 10k steps)")
    pretrain.add_argument("--lr", type=float, default=5e-4, help="AdamW lr of full training and of the parameters "
                                                                 "LoQT does not convert")
    pretrain.add_argument("--loqt-lr", type=float, default=1e-2, help="AdamW lr of B (the paper: 1e-2)")
    finetune = kinds.add_parser("finetune", help="a pretrained workload: LoRA vs LoQT, LoQT-nq, LoQT at twice the "
                                                 "rank")
    finetune.add_argument("--workload", default="minilm-real", choices=workload_names())
    finetune.add_argument("--steps", type=int_at_least(1), default=80)
    finetune.add_argument("--rank", type=int_at_least(1), default=16)
    finetune.add_argument("--scale", type=float, default=2.0, help="s in W + s P B (the paper's GLUE: 2)")
    finetune.add_argument("--first-interval", type=int_at_least(1), default=20)
    finetune.add_argument("--lr", type=float, default=1e-3, help="AdamW lr of LoRA")
    finetune.add_argument("--loqt-lr", type=float, default=3e-4, help="AdamW lr of B")
    for training in (pretrain, finetune):
        training.add_argument("--eval-batches", type=int_at_least(1), default=8,
                              help="held-out batches (after the training ones) the loss is scored on")
        training.add_argument("--seed", type=int, default=0, help="seeds the initial weights (random-init models)")
    memory = kinds.add_parser("memory", help="bytes per weight, trainable parameters, optimizer state: "
                                             "full vs LoRA vs LoQT on the real model")
    memory.add_argument("--workload", default="llama-small", choices=workload_names())
    memory.add_argument("--lora-rank", type=int_at_least(1), default=16)
    memory.add_argument("--rank", type=int_at_least(1), default=16, help="LoQT's rank when only B trains")
    memory.add_argument("--pretrain-rank", type=int_at_least(1), default=256,
                        help="LoQT's rank when pretraining (the paper's ratio: hidden / 4)")
    for kind in (pretrain, finetune, memory):
        add_outputs(kind)
        kind.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fxmem_bench import loqt as harness

    workload = get_workload(args.workload)
    if args.loqt_experiment == "memory":
        settings = harness.memory_settings(workload, lora_rank=args.lora_rank, loqt_rank=args.rank,
                                           pretrain_rank=args.pretrain_rank)
        results = []
        with console.status("measuring") as status:
            for setting, adapter_only in settings:
                status.update(f"{workload.name}: {setting.name}")
                results.append(harness.memory_row(workload, setting, adapter_only=adapter_only))
        title = f"{workload.name}: the targeted linears' weights, trainable parameters, AdamW state"
        columns, rows = harness.MEMORY_COLUMNS, harness.memory_rows(results)
        legend = ("W bits/param: stored bits of the targeted linears' weights per parameter (NF4: 4-bit codes, "
                  "8-bit block scales, their float32 scales). W + P + adapter: everything those linears store "
                  "(LoRA's A and B, LoQT's P and B), per parameter of W. optimizer state: AdamW's, measured.")
    else:
        pretraining = args.loqt_experiment == "pretrain"
        if pretraining:
            settings = harness.pretrain_settings(args.rank, scale=args.scale, first_interval=args.first_interval)
        else:
            settings = harness.finetune_settings(workload, args.rank, scale=args.scale,
                                                 first_interval=args.first_interval)
        console.print(f"{workload.name} ({workload.description}), {args.steps} AdamW steps each, "
                      f"lr {args.lr}, B's lr {args.loqt_lr}, rank {args.rank}, s {args.scale}, first merge after "
                      f"{args.first_interval} steps, seed {args.seed}")
        with progress_bars(24) as progress:
            tasks = {s.name: progress.add_task(s.name, total=args.steps, loss="—") for s in settings}
            results = [harness.train(workload, s, steps=args.steps, lr=args.lr, loqt_lr=args.loqt_lr,
                                     eval_batches=args.eval_batches, adapter_only=not pretraining, seed=args.seed,
                                     on_step=lambda name, step, loss: progress.update(
                                         tasks[name], completed=step, loss=f"{loss:.4f}"))
                       for s in settings]
        reference = results[0]
        title = f"{workload.name}: {args.loqt_experiment}, {args.steps} steps"
        columns = [c.format(reference="full" if pretraining else "LoRA") for c in harness.RUN_COLUMNS]
        rows = harness.run_rows(results, reference)
        legend = (f"eval loss: mean over {args.eval_batches} held-out batches after the last step; at start: "
                  "after conversion, before training. merges: LoQT's, after the first projection. W bits/param: "
                  "stored bits of the converted (or targeted) linears' weights per parameter.")
    print_table(title, columns, rows, legend, args)
    write_json(results, args)
    return 0
