"""Where a quantized plan loses the gradient on a pretrained decoder: options and roles, at the same weights.

    python benchmarks/pretrained_fidelity.py options [WORKLOAD]   # each quantization option, 4 and 2 bits
    python benchmarks/pretrained_fidelity.py roles BITS [WORKLOAD]  # the paper's plan at BITS, one role at 8 bits

One model (llama-pretrained by default), its LoRA B drawn at std 0.02 (an adapter past PEFT's zero start, as
mid-way through a fine-tune), three batches of its fine-tuning text. For each plan: the bytes saved for backward,
and every LoRA gradient of the three batches against eager's at the same weights (worst cosine, mean of the
batches' median relative errors, the worst parameter). `fxmem bench ablate` measures the same through training,
where every setting's weights differ; this compares plans on identical weights. `roles` raises one role at a
time by patching the planner's bit choice (cost_model.options.configured_bits): a diagnostic, not an option.
Results: docs/quantization.md ("Why each setting"), and in full docs/history/quantization-notes-2026-11.md.
"""

import sys

import torch

import fxmem
from fxmem.analysis import Role
from fxmem.config import Config
from fxmem.cost_model import options
from fxmem.measure import gradient_fidelity, model_tensors, saved_bytes_and_gradients
from fxmem_bench.workloads import get_workload

PAPER = {"rebuild_from_x": False}  # the presets before rebuild_from_x: X W and norm inputs stored at bits
OPTIONS = [
    ("4-bit", "hyclora-4bit", PAPER), ("4-bit, rotated 64", "hyclora-4bit", {**PAPER, "rotation": 64}),
    ("4-bit, stochastic", "hyclora-4bit", {**PAPER, "stochastic_rounding": True}),
    ("4-bit, lora_reorder off", "hyclora-4bit", {**PAPER, "lora_reorder": False}),
    ("4-bit, inter only", "hyclora-4bit", {**PAPER, "intra": False}),
    ("hyclora at 8 bits", "hyclora-4bit", {**PAPER, "bits": 8}),
    ("4-bit, rebuilt from x (the preset)", "hyclora-4bit", {}),
    ("2-bit", "hyclora-2bit", PAPER), ("2-bit, rotated 64", "hyclora-2bit", {**PAPER, "rotation": 64}),
    ("2-bit, rotated 256", "hyclora-2bit", {**PAPER, "rotation": 256}),
    ("2-bit, stochastic", "hyclora-2bit", {**PAPER, "stochastic_rounding": True}),
    ("2-bit, linear inputs 2-bit", "hyclora-2bit", {**PAPER, "linear_input_bits": None}),
    ("2-bit, no outlier values", "hyclora-2bit", {**PAPER, "outlier_values": 0.0}),
    ("2-bit, rebuilt from x (the preset)", "hyclora-2bit", {}),
    ("2-bit, rebuilt from x, linear inputs 8-bit", "hyclora-2bit", {"linear_input_bits": 8}),
]
RAISED = [None, Role.LORA_BASE_OUTPUT, Role.LINEAR_INPUT, Role.NORM_INPUT, Role.ACT_INPUT, Role.PRODUCT_INPUT]


def main() -> None:
    mode = sys.argv[1]
    bits = int(sys.argv[2]) if mode == "roles" else None
    rest = sys.argv[3:] if mode == "roles" else sys.argv[2:]
    setup = get_workload(rest[0] if rest else "llama-pretrained").build()
    batches = [next(setup.batches) for _ in range(3)]
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in setup.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    exclude = model_tensors(setup.model)
    references = [saved_bytes_and_gradients(setup.model, lambda b=b: setup.loss(setup.model, b),
                                            exclude + list(b.values())) for b in batches]
    print(f"eager saved {references[0][0] / 2**20:.2f} MiB")
    if mode == "options":
        for name, preset, overrides in OPTIONS:
            measure(setup, batches, references, exclude, name, Config.from_preset(preset, **overrides))
        return
    configured = options.configured_bits
    for role in RAISED:
        options.configured_bits = lambda owner, config, role=role: (
            8 if role is not None and role in (owner.role, *owner.also) else configured(owner, config))
        measure(setup, batches, references, exclude, f"{bits}-bit, {role.value if role else 'no role'} at 8 bits",
                Config.from_preset(f"hyclora-{bits}bit", **PAPER))
    options.configured_bits = configured


def measure(setup, batches, references, exclude, name: str, config: Config) -> None:
    torch._dynamo.reset()
    forward = torch.compile(setup.model, backend=fxmem.Backend(config))
    fidelities = []
    for batch, (_, reference) in zip(batches, references, strict=True):
        saved, grads = saved_bytes_and_gradients(setup.model, lambda: setup.loss(forward, batch),
                                                 exclude + list(batch.values()))
        fidelities.append(gradient_fidelity(reference, grads))
    worst = min(fidelities, key=lambda f: f.min_cosine)
    median = sum(f.median_relative_error for f in fidelities) / len(fidelities)
    print(f"| {name} | {saved / 2**20:.2f} MiB | {worst.min_cosine:.4f} | {median:.4f} | "
          f"{worst.worst_parameter.removeprefix('base_model.model.model.')} |", flush=True)


if __name__ == "__main__":
    main()
