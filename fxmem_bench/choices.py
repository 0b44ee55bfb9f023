"""The names the experiments take (workloads, methods, points, ...) in plain Python: the experiments import them from
here, and `fxmem bench` builds its parsers from them without importing torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fxmem.config import Config

# Every workload (workloads.py defines them) and its model family, in the order the command lists them
WORKLOAD_FAMILIES = {
    "llama-tiny": "llama", "llama-small": "llama", "qlora-tiny": "llama", "qlora-small": "llama",
    "llama-pretrained": "llama", "llama-7b-shape": "llama", "llama3-bf16-small": "llama", "llama3-8b-shape": "llama",
    "minilm-real": "bert",
}

# compare.py
COMPARE_METHODS = ("eager", "compile", "compile-budget", "hf-checkpointing", "compile-checkpointing",
                   "compile-checkpointing-lce", "compile-checkpointing-liger", "compile-checkpointing-offload",
                   "compile-sac", "compile-offload", "fxmem")
FRONTIER_TARGETS = (0.5, 0.3, 0.15, 0.08)  # frontier.py's, fractions of what torch.compile saves

# context.py: the baselines measured beside fxmem's presets (by default, those that run on the device: the
# last two on CUDA, where installed). compile-budget runs at its lowest setting: the least that inductor's own
# solver saves.
CONTEXT_BASELINES = ("eager", "compile", "compile-budget", "compile-checkpointing", "compile-checkpointing-lce",
                     "compile-checkpointing-liger", "compile-checkpointing-offload")
CONTEXT_PRESETS = ("exact", "hyclora-4bit")

# coverage.py's families (transformers' model_type of each)
COVERAGE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "olmo2", "gemma", "gemma2", "gemma3_text", "granite",
                     "starcoder2", "phi3", "phi", "gpt_neox", "gpt2", "opt", "bert", "mixtral", "qwen3_moe", "gpt_oss",
                     "deepseek_v3")
COVERAGE_DTYPES = ("fp32", "bf16")

# guard.py: name -> (coverage family, preset, overrides), each bending the gradient on purpose; and the
# presets checked as shipped
GUARD_BENT_SETTINGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "1-bit codes everywhere": ("llama", "hyclora-4bit", {"bits": 1, "qkv_bits": None, "linear_input_bits": None}),
    "attention sparsity 0.02": ("gemma2", "hyclora-4bit", {"attn_sparsity": 0.02}),
    "rank-2 lowrank": ("llama", "loract", {"lowrank": 2}),
}
GUARD_PRESETS = ("hyclora-4bit", "hyclora-2bit", "loract")

# recipes.py: issue 46's recipe matrix
RECIPES = ("plain", "dropout", "autocast", "packed", "accumulation", "qlora")
RECIPE_PRESETS = ("exact", "hyclora-4bit", "loract")

# fidelity.py
FIDELITY_BASELINES = ("eager", "compile")
FIDELITY_TOKENS = ("text", "random")  # the workload's real text, or ids drawn uniformly from the vocabulary

# hift.py
HIFT_COMPILE_CHOICES = ("none", "fxmem", "inductor")
HIFT_SCOPES = ("blocks", "model")

# loss.py
LOSS_METHODS = ("unfused", "unfused-compile", "auto-chunker", "linear-cross-entropy",
                "linear-cross-entropy-chunked", "fxmem")


@dataclass(frozen=True)
class Point:
    """A point of gpu_check.py's table."""

    key: str  # what --points names it
    label: str  # as the table shows it
    method: str  # compare.py's method
    preset: str = "exact"
    return_logits: bool = True
    budget: float | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def config(self) -> Config:
        return Config.from_preset(self.preset, return_logits=self.return_logits, **dict(self.options))


POINTS: tuple[Point, ...] = (
    Point("eager", "eager PEFT", "eager"),
    Point("compile", "torch.compile", "compile"),
    Point("budget-0.15", "activation_memory_budget 0.15", "compile-budget", budget=0.15),
    Point("budget-0.05", "activation_memory_budget 0.05", "compile-budget", budget=0.05),
    Point("hf-checkpointing", "HF gradient checkpointing", "hf-checkpointing"),
    Point("exact", "fxmem exact", "fxmem"),
    Point("exact-no-logits", "fxmem exact, no logits", "fxmem", return_logits=False),
    Point("hyclora-4bit", "fxmem hyclora-4bit", "fxmem", "hyclora-4bit"),
    Point("hyclora-4bit-no-logits", "fxmem hyclora-4bit, no logits", "fxmem", "hyclora-4bit", return_logits=False),
    Point("hyclora-4bit-no-logits-fp32-lora", "fxmem hyclora-4bit, no logits, fp32 LoRA products", "fxmem",
          "hyclora-4bit", return_logits=False, options=(("lora_half_products", "off"),)),
    Point("hyclora-2bit-no-logits", "fxmem hyclora-2bit, no logits", "fxmem", "hyclora-2bit", return_logits=False),
    # the long-context plan, its stored block inputs on the device and in host memory (the same gradients expected)
    Point("hyclora-4bit-blocks", "fxmem hyclora-4bit, no logits, blocks checkpointed", "fxmem", "hyclora-4bit",
          return_logits=False, options=(("block_checkpoint", True), ("mlp_chunk", 2048))),
    Point("hyclora-4bit-blocks-offload", "fxmem hyclora-4bit, no logits, blocks checkpointed, inputs in host memory",
          "fxmem", "hyclora-4bit", return_logits=False,
          options=(("block_checkpoint", True), ("mlp_chunk", 2048), ("block_offload", True))),
)
POINT_KEYS = tuple(p.key for p in POINTS)
