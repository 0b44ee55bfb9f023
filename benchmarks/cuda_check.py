"""What docs/gpu.md says waits for a GPU, in one call on one:

    python benchmarks/cuda_check.py --json cuda-check.json [--steps 10] [--workload llama-small]

(``--device cpu`` runs the same code on the CPU, where there is nothing fused and no graph to capture: a dry run.)

1. ``epilogue``: llama-small at hyclora-4bit (bf16): fxmem with its LoRA epilogues left to inductor (the default)
   and in its fused Triton kernels (``fused_epilogue=True``), beside eager PEFT, torch.compile and HF
   checkpointing, timed interleaved in one process: step time, peak, saved bytes and gradient fidelity against
   eager, and what fxmem's report says it fused with the kernels asked for.
2. ``cudagraphs``: llama-tiny at hyclora-4bit, a training step under inductor's CUDA graphs
   (``options={"triton.cudagraphs": True}``) against the same step without: the losses of each step, and what
   inductor's counters say it captured or skipped.

Every warning fxmem raises (a region that inductor could not lower runs as aten ops) is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings

import torch

import fxmem
from fxmem.config import Config
from fxmem.timing import warm_up_compiler
from fxmem_bench.compare import prepare_method, time_interleaved
from fxmem_bench.workloads import Workload, get_workload

PRESET = "hyclora-4bit"


FUSED = "fxmem (fused_epilogue=True)"
METHODS = ("eager", "compile", "hf-checkpointing", "fxmem", FUSED)


def epilogue(workload: str, device: str, steps: int) -> dict:
    """fxmem with its epilogues left to inductor (the default) and in its fused Triton kernels, beside eager,
    torch.compile and HF checkpointing: every method built cold and timed interleaved in this one process."""
    work, config = get_workload(workload), Config.from_preset(PRESET)
    torch._dynamo.reset()
    warm_up_compiler()
    prepared, reference = {}, None
    with torch.compiler.config.patch(force_disable_caches=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for label in METHODS:
            fused = dataclasses.replace(config, fused_epilogue=True) if label == FUSED else config
            prepared[label] = prepare_method(work, label.split()[0], config=fused, device=torch.device(device),
                                             lora_rank=16, budget=None, reference_grads=reference, label=label)
            reference = reference or prepared[label].grads
            print(f"built {label}", flush=True)
    results = {r.label: r for r in time_interleaved(prepared, steps=steps, device=torch.device(device))}
    compiled = results["compile"]
    for r in results.values():
        cosine = f"{r.fidelity.min_cosine:.6f}" if r.fidelity else "reference"
        print(f"{r.label:>40}: step {r.step_seconds / compiled.step_seconds:.3f}x torch.compile's, peak "
              f"{r.peak_bytes / 2**20:.1f} MiB, saved {r.saved_bytes / 2**20:.1f} MiB, min cosine {cosine}",
              flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = pass_summaries(work, device, dataclasses.replace(config, fused_epilogue=True))
    print("fxmem's report:", *report, sep="\n  ", flush=True)
    return {"results": [r.to_dict() for r in results.values()], "report": report,
            "warnings": [str(w.message) for w in caught if "fxmem" in str(w.message)]}


def pass_summaries(workload: Workload, device: str, config: Config) -> list[str]:
    """Each pass's line in fxmem's report for one step of ``workload`` under ``config``."""
    torch._dynamo.reset()
    setup = workload.build(device=device)
    backend = fxmem.Backend(config)
    setup.loss(torch.compile(setup.model, backend=backend), next(setup.batches)).backward()
    lines = [f"region {r.index} {p.name}: {p.note}" for r in backend.regions for p in r.passes if p.note]
    lines += [f"region {r.index} note: {n}" for r in backend.regions for n in r.notes]
    torch._dynamo.reset()
    return lines


def cudagraphs(device: str, steps: int) -> dict:
    """The same training steps with and without inductor's CUDA graphs, from the same weights and batches."""
    out = {}
    for graphs in (False, True):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        setup = get_workload("llama-tiny").build(device=device)
        batches = [next(setup.batches) for _ in range(steps)]
        model = torch.compile(setup.model, backend="fxmem", options={"preset": PRESET, "triton.cudagraphs": graphs})
        optimizer = torch.optim.AdamW([p for p in setup.model.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for batch in batches:
                if graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                loss = setup.loss(model, batch)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.item())
        counters = {group: dict(values) for group, values in torch._dynamo.utils.counters.items()
                    if group in ("inductor", "stats") and values}
        out["on" if graphs else "off"] = {
            "losses": losses, "counters": {g: {k: v for k, v in c.items() if "cudagraph" in k} for g, c in
                                           counters.items()},
            "warnings": [str(w.message) for w in caught if "fxmem" in str(w.message) or "cudagraph" in
                         str(w.message).lower()]}
        print(f"cudagraphs {'on' if graphs else 'off'}: losses {[round(x, 5) for x in losses]}, "
              f"counters {out['on' if graphs else 'off']['counters']}", flush=True)
    off, on = out["off"]["losses"], out["on"]["losses"]
    out["max_relative_loss_difference"] = max(abs(a - b) / abs(a) for a, b in zip(off, on))
    print(f"cudagraphs: largest relative loss difference {out['max_relative_loss_difference']:.2e}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workload", default="llama-small", help="epilogue's workload (cudagraphs: llama-tiny)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", nargs="+", choices=("epilogue", "cudagraphs"), default=("cudagraphs", "epilogue"))
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this check runs on a CUDA GPU (torch.cuda.is_available() is False here); --device cpu: "
                         "a dry run")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"device": name, "torch": torch.__version__}
    parts = {"epilogue": lambda: epilogue(args.workload, args.device, args.steps),
             "cudagraphs": lambda: cudagraphs(args.device, args.steps)}
    for part in args.parts:
        try:
            results[part] = parts[part]()
        except Exception as error:  # one part's failure is a finding; the other part still runs
            results[part] = {"error": f"{type(error).__name__}: {error}"}
            print(f"{part} failed: {type(error).__name__}: {error}", flush=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)


if __name__ == "__main__":
    main()
