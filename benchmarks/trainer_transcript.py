"""The README's Trainer line on llama-tiny against the Trainer's own inductor compile (torch_compile=True).

    python benchmarks/trainer_transcript.py [preset]

Five steps each from the same weights on the same rows; prints both loss curves and their largest relative
difference. Under `exact` they agree to fp32 tolerance (docs/benchmarks.md, "HF Trainer").
"""

import sys
import tempfile

import torch
from transformers import Trainer, TrainingArguments

import fxmem
from fxmem.measure import format_bytes
from fxmem_bench.workloads import get_workload


def train(compile_with: str, preset: str) -> tuple[list[float], fxmem.Backend | None]:
    setup = get_workload("llama-tiny").build()
    ids = next(setup.batches)["input_ids"]
    rows = [{"input_ids": row, "labels": row} for row in ids] * 3
    backend = fxmem.compile_(setup.model, preset=preset) if compile_with == "fxmem" else None  # the README's line
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=5, per_device_train_batch_size=4,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, data_seed=0, torch_compile=compile_with == "inductor", disable_tqdm=True)
    trainer = Trainer(model=setup.model, args=args, train_dataset=rows)
    trainer.train()
    torch._dynamo.reset()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], backend


def main(preset: str = "exact") -> None:
    fxmem_losses, backend = train("fxmem", preset)
    inductor_losses, _ = train("inductor", preset)
    print(f"fxmem.compile_(model, preset={preset!r}) + Trainer:", fxmem_losses)
    print("Trainer(torch_compile=True):", inductor_losses)
    largest = max(abs(a - b) / b for a, b in zip(fxmem_losses, inductor_losses, strict=True))
    print("largest relative difference:", largest)
    report = backend.report()
    notes = [f"region {r.index}: {note}" for r in report.regions for note in r.notes]
    print(f"fxmem saved activations: {format_bytes(report.planned_bytes)}", *notes, sep="\n  ")


if __name__ == "__main__":
    main(*sys.argv[1:])
