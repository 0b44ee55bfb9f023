"""LoRA dropout against none, issue 46's workload: what each preset plans and how close its gradients stay.

    python benchmarks/lora_dropout.py --presets hyclora-4bit exact loract --json lora-dropout.json

A 2-layer GQA Llama (hidden 256, 8 heads, 2 KV heads, random weights), 2 x 256 tokens, fp32, PEFT LoRA r=16 on
every linear with B drawn past init, ``lora_dropout`` 0 and 0.05. Each preset's planned saved bytes (its report) and
its worst LoRA-gradient cosine against torch.compile's on the same batch with the same seed, so the same dropout
masks (inductor draws them from the step's seed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

import torch

os.environ.setdefault("FXMEM_STRICT", "0")  # a preset that leaves a dropout LoRA alone is what this measures

import fxmem
from fxmem.cli.common import run_metadata
from fxmem.measure import gradient_fidelity

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(dropout: float) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=16, lora_dropout=dropout,
                                                                target_modules=TARGETS))
    generator = torch.Generator().manual_seed(7)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # past PEFT's zeros, where A's gradient is zero
            parameter.data.copy_(torch.randn(parameter.shape, generator=generator) * 0.02)
    ids = torch.randint(0, 1024, (2, 256), generator=torch.Generator().manual_seed(1))
    return model.train(), {"input_ids": ids, "labels": ids}


def gradients(model: torch.nn.Module, batch: dict[str, torch.Tensor], backend: object) -> dict[str, torch.Tensor]:
    torch._dynamo.reset()
    torch.manual_seed(3)  # the same seed: the same masks
    torch.compile(model, backend=backend)(**batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["hyclora-4bit", "exact", "loract"])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = []
    for dropout in (0.0, 0.05):
        model, batch = build(dropout)
        reference = gradients(model, batch, "inductor")
        for preset in args.presets:
            backend = fxmem.backend(preset)
            grads = gradients(model, batch, backend)
            report = backend.report()
            row = {"preset": preset, "lora_dropout": dropout, "saved_bytes": report.activation_bytes,
                   "planned_bytes": report.planned_bytes,
                   "min_cosine": gradient_fidelity(reference, grads).min_cosine}
            results.append(row)
            print(f"{preset:14} dropout {dropout:<5} planned {row['planned_bytes'] / 2**20:7.3f} MiB of "
                  f"{row['saved_bytes'] / 2**20:7.3f}, worst LoRA-grad cosine vs torch.compile {row['min_cosine']:.6f}")
    if args.json:
        args.command_line = "python " + " ".join(shlex.quote(a) for a in sys.argv)
        with open(args.json, "w") as out:
            json.dump({**run_metadata(args), "results": results}, out, indent=1)


if __name__ == "__main__":
    main()
