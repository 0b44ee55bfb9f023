"""`fxmem bench coverage`: how much each transformer family saves under fxmem, and why the rest is kept.

Tiny configs of transformers' decoder and encoder families, chosen to cover the
patterns a rule can miss: separate or fused q/k/v, a fused gate+up, partial
rotary, a parallel attention+MLP residual, Conv1D (transposed) weights, GELU,
tanh-GELU and ReLU MLPs, LayerNorm and learned positions. Each is 2 layers,
hidden 128, LoRA r=8 on every linear (PEFT's "all-linear"), dropout off,
``use_cache=False``, LoRA B drawn past its zero init, one seeded batch of random tokens. Per family and preset:
the bytes autograd holds for backward, eager PEFT's against fxmem's (measured:
unique storages, parameters and inputs left out), the LoRA gradients against
eager's at the initial weights and, with ``steps``, again after that many AdamW
steps trained under fxmem, and the largest groups of bytes the plan keeps exact,
by the rule that kept them (``Report.kept_by_reason``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxmem.backend import Backend
from fxmem.bench.workloads import draw_lora_b
from fxmem.config import Config
from fxmem.measure import Fidelity, gradient_fidelity, model_tensors, saved_bytes_and_gradients

HIDDEN, LAYERS, HEADS, INTERMEDIATE, VOCAB = 128, 2, 4, 256, 256
BATCH, SEQ, LORA_RANK = 2, 64, 8
LEARNING_RATE = 1e-3  # AdamW's, for ``steps``
LORA_B_STD = 0.02  # B drawn past PEFT's zeros (draw_lora_b), so that A's gradient is compared too


@dataclass(frozen=True)
class Family:
    name: str  # transformers' model_type
    patterns: str  # what it covers
    settings: dict[str, Any]  # config entries beyond the shared shape
    masked_lm: bool = False


FAMILIES = (
    Family("llama", "separate q/k/v, SwiGLU, RMSNorm, full RoPE", {}),
    Family("qwen2", "Llama-like with q/k/v biases", {}),
    Family("gemma", "GeGLU (tanh-GELU gate), RMSNorm, tied head", {"head_dim": HIDDEN // HEADS}),
    Family("phi3", "one fused q/k/v projection, one fused gate+up, split after the matmul", {"pad_token_id": 0}),
    Family("phi", "separate q/k/v, partial rotary, parallel attention+MLP, GELU, LayerNorm",
           {"partial_rotary_factor": 0.5}),
    Family("gpt_neox", "fused q/k/v, partial rotary, parallel residual, GELU, LayerNorm",
           {"rotary_pct": 0.25, "use_parallel_residual": True}),
    Family("gpt2", "fused q/k/v through Conv1D (transposed) weights, tanh-GELU, LayerNorm, learned positions",
           {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_inner": INTERMEDIATE, "n_positions": SEQ}),
    Family("opt", "separate q/k/v, ReLU MLP, LayerNorm, learned positions",
           {"ffn_dim": INTERMEDIATE, "word_embed_proj_dim": HIDDEN}),
    Family("bert", "encoder: separate q/k/v, GELU, LayerNorm, learned positions, masked-LM head with a bias", {},
           masked_lm=True),
)


@dataclass(frozen=True)
class CoverageResult:
    family: str
    preset: str
    eager_bytes: int
    saved_bytes: int  # measured under fxmem
    planned_bytes: int  # fxmem's report
    fidelity: Fidelity  # at the initial weights
    kept: dict[str, dict[str, int]]  # Report.kept_by_reason
    steps: int = 0
    trained_fidelity: Fidelity | None = None  # after ``steps`` steps trained under fxmem, on the first batch

    @property
    def reduction(self) -> float:
        return self.eager_bytes / self.saved_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "preset": self.preset, "eager_bytes": self.eager_bytes,
                "saved_bytes": self.saved_bytes, "planned_bytes": self.planned_bytes,
                "reduction": self.reduction, "fidelity": self.fidelity.to_dict(), "kept_by_reason": self.kept,
                "steps": self.steps,
                "trained_fidelity": self.trained_fidelity.to_dict() if self.trained_fidelity else None}


def get_family(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown family {name!r}; valid families: {', '.join(f.name for f in FAMILIES)}")


def build(family: Family) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The family's tiny model with LoRA on every linear, and its first batch (seeded)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family.name, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                  intermediate_size=INTERMEDIATE, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                  use_cache=False, **family.settings)
    for key, value in config.to_dict().items():  # dropout off, whatever the family calls it
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    config._attn_implementation = "sdpa"
    model_class = AutoModelForMaskedLM if family.masked_lm else AutoModelForCausalLM
    model = get_peft_model(model_class.from_config(config),
                           LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0,
                                      target_modules="all-linear"))
    draw_lora_b(model, LORA_B_STD)
    return model, batch_of(0)


def batch_of(seed: int) -> dict[str, torch.Tensor]:
    """A batch of random tokens, the model's targets its inputs."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def measure(family: Family, presets: Sequence[str], *, lowering: str = "eager", steps: int = 0
            ) -> list[CoverageResult]:
    """Eager PEFT's bytes and gradients on the family's batch, then fxmem's under each preset, compiled afresh;
    with ``steps``, each preset then trains its own copy that many steps and is compared again."""
    model, batch = build(family)
    exclude = model_tensors(model) + list(batch.values())

    def run(forward: Callable[..., Any]) -> tuple[int, dict[str, torch.Tensor]]:
        return saved_bytes_and_gradients(model, lambda: forward(**batch).loss, exclude)

    eager_bytes, reference = run(model)
    results = []
    for preset in presets:
        torch._dynamo.reset()
        backend = Backend(Config.from_preset(preset), lowering=lowering)
        saved, grads = run(torch.compile(model, backend=backend))
        report = backend.report()
        trained = _trained_fidelity(family, preset, lowering, steps) if steps else None
        results.append(CoverageResult(family.name, preset, eager_bytes, saved, report.planned_bytes,
                                      gradient_fidelity(reference, grads), report.kept_by_reason(), steps, trained))
    torch._dynamo.reset()
    return results


def _trained_fidelity(family: Family, preset: str, lowering: str, steps: int) -> Fidelity:
    """A fresh copy trained ``steps`` AdamW steps under fxmem (a new batch each), then its LoRA gradients on the
    first batch against eager's at the same weights."""
    torch._dynamo.reset()
    model, first = build(family)
    compiled = torch.compile(model, backend=Backend(Config.from_preset(preset), lowering=lowering))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    for step in range(steps):
        compiled(**batch_of(step + 1)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    exclude = model_tensors(model) + list(first.values())
    _, reference = saved_bytes_and_gradients(model, lambda: model(**first).loss, exclude)
    _, grads = saved_bytes_and_gradients(model, lambda: compiled(**first).loss, exclude)
    return gradient_fidelity(reference, grads)
