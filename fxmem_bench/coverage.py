"""`fxmem bench coverage`: how much each transformer family saves under fxmem, and why the rest is kept.

Tiny configs of transformers' decoder and encoder families, chosen to cover the
patterns a rule can miss: separate or fused q/k/v, q/k norms, norms after a
sublayer, a fused gate+up, partial rotary, a parallel attention+MLP residual,
scalar multipliers, eager attention with soft-capped scores and a sliding
window, Conv1D (transposed) weights, GELU, tanh-GELU and ReLU MLPs, LayerNorm
and learned positions; and four mixtures of experts (a router, stacked experts:
4 experts, top 2). Each is 2 layers, hidden 128, 4 heads (2 key/value heads
where the family has grouped-query attention), LoRA r=8 on every linear (PEFT's
"all-linear"), dropout off, ``use_cache=False``, LoRA B drawn past its zero
init, one batch of real text (the standard library's source as byte ids), in
float32 or in bfloat16 with PEFT's float32 adapters. Per family and preset:
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
from fxmem.config import Config
from fxmem.measure import Fidelity, gradient_fidelity, model_tensors, saved_bytes_and_gradients
from fxmem.peft_lora import prepare_peft
from fxmem_bench.choices import COVERAGE_DTYPES as DTYPES
from fxmem_bench.data import byte_windows, stdlib_bytes
from fxmem_bench.workloads import draw_lora_b

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB = 128, 2, 4, 2, 256, 256
BATCH, SEQ, LORA_RANK = 2, 128, 8
WINDOW = SEQ // 4  # a sliding window shorter than the batch's rows, where the family has one
LEARNING_RATE = 1e-3  # AdamW's, for ``steps``
LORA_B_STD = 0.02  # B drawn past PEFT's zeros (draw_lora_b), so that A's gradient is compared too


@dataclass(frozen=True)
class Family:
    name: str  # transformers' model_type
    patterns: str  # what it covers
    settings: dict[str, Any]  # config entries beyond the shared shape
    masked_lm: bool = False
    attention: str = "sdpa"  # transformers' attn_implementation: the family's own where it needs one
    # stacked expert weights LoRA targets beside "all-linear", where PEFT's "all-linear" leaves them out (gpt-oss:
    # its checkpoints store them fused, so PEFT has no per-expert linears to map; OpenAI's fine-tuning recipe names
    # them)
    lora_parameters: tuple[str, ...] = ()


HEAD_DIM = HIDDEN // HEADS
FAMILIES = (
    Family("llama", "separate q/k/v, SwiGLU, RMSNorm, full RoPE", {}),
    Family("qwen2", "Llama-like with q/k/v biases", {}),
    Family("qwen3", "RMSNorm on q and k per head", {"head_dim": HEAD_DIM}),
    Family("mistral", "Llama-like with a sliding window", {"sliding_window": WINDOW}),
    Family("olmo2", "RMSNorms after attention and MLP (not before), on q and k too", {}),
    Family("gemma", "GeGLU (tanh-GELU gate), RMSNorm, tied head", {"head_dim": HEAD_DIM}),
    Family("gemma2", "eager attention with soft-capped scores, a sliding window every other layer, norms before "
           "and after each sublayer, soft-capped logits",
           {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": WINDOW}, attention="eager"),
    Family("gemma3_text", "q/k norms, norms before and after each sublayer, local and global layers",
           {"head_dim": HEAD_DIM, "query_pre_attn_scalar": HEAD_DIM, "sliding_window": WINDOW}),
    Family("granite", "Llama-like with residual, attention, embedding and logit multipliers",
           {"residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "embedding_multiplier": 12.0,
            "logits_scaling": 8.0}),
    Family("starcoder2", "LayerNorm, GELU MLP with biases, grouped-query attention", {"sliding_window": None}),
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
    # mixtures of experts: 4 experts, top 2; PEFT's "all-linear" adapts the router and the experts too
    Family("mixtral", "MoE: a softmax router, then top-k; experts as stacked weights", {"num_local_experts": 4,
                                                                                       "num_experts_per_tok": 2}),
    Family("qwen3_moe", "MoE: q/k norms, top-k probabilities renormalized",
           {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": INTERMEDIATE, "head_dim": HEAD_DIM,
            "norm_topk_prob": True}),
    Family("gpt_oss", "MoE: attention sinks, top-k before the softmax, clamped SwiGLU experts with biases",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": HEAD_DIM, "sliding_window": WINDOW},
           attention="eager", lora_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
    Family("deepseek_v3", "MoE: latent attention (MLA), a sigmoid router with a bias, a shared expert",
           {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": INTERMEDIATE,
            "n_shared_experts": 1, "first_k_dense_replace": 0, "n_group": 1, "topk_group": 1, "q_lora_rank": 64,
            "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": HEAD_DIM,
            "num_key_value_heads": HEADS}),  # latent attention makes k and v per head
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
    dtype: str = "fp32"  # the model's (DTYPES); the adapters float32, as PEFT keeps them

    @property
    def reduction(self) -> float:
        return self.eager_bytes / self.saved_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "preset": self.preset, "eager_bytes": self.eager_bytes,
                "saved_bytes": self.saved_bytes, "planned_bytes": self.planned_bytes,
                "reduction": self.reduction, "fidelity": self.fidelity.to_dict(), "kept_by_reason": self.kept,
                "steps": self.steps, "dtype": self.dtype,
                "trained_fidelity": self.trained_fidelity.to_dict() if self.trained_fidelity else None}


def get_family(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown family {name!r}; valid families: {', '.join(f.name for f in FAMILIES)}")


def build(family: Family, dtype: str = "fp32") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The family's tiny model in ``dtype`` with LoRA on every linear (float32 adapters, as PEFT keeps them), B
    drawn past its zeros, and its first batch."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}")
    torch.manual_seed(0)
    shape = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
             "num_key_value_heads": KV_HEADS, "intermediate_size": INTERMEDIATE, "vocab_size": VOCAB,
             "max_position_embeddings": SEQ, "use_cache": False}
    config = AutoConfig.for_model(family.name, **{**shape, **family.settings})  # a family's settings win
    for key, value in config.to_dict().items():  # dropout off, whatever the family calls it
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    config._attn_implementation = family.attention
    model_class = AutoModelForMaskedLM if family.masked_lm else AutoModelForCausalLM
    model = model_class.from_config(config).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0,
                                             target_modules="all-linear",
                                             target_parameters=list(family.lora_parameters) or None))
    draw_lora_b(model, LORA_B_STD)
    return model, batch_of(0)


def batch_of(index: int) -> dict[str, torch.Tensor]:
    """The ``index``-th batch of real text: BATCH windows of SEQ bytes of the standard library's source, the
    model's targets its inputs."""
    start = index * BATCH * SEQ
    ids = byte_windows([stdlib_bytes(start + BATCH * SEQ)[start:]], SEQ)
    return {"input_ids": ids, "labels": ids}


def measure(family: Family, presets: Sequence[str], *, lowering: str = "eager", steps: int = 0,
            dtype: str = "fp32") -> list[CoverageResult]:
    """Eager PEFT's bytes and gradients on the family's batch, then fxmem's under each preset, compiled afresh
    (the model prepared as ``fxmem.compile_`` prepares it);
    with ``steps``, each preset then trains its own copy that many steps and is compared again."""
    model, batch = build(family, dtype)
    exclude = model_tensors(model) + list(batch.values())

    def run(forward: Callable[..., Any]) -> tuple[int, dict[str, torch.Tensor]]:
        return saved_bytes_and_gradients(model, lambda: forward(**batch).loss, exclude)

    eager_bytes, reference = run(model)
    prepare_peft(model)  # PEFT's parametrized LoRA (routers, experts) made compilable; no preset chunks the experts
    results = []
    for preset in presets:
        torch._dynamo.reset()
        backend = Backend(Config.from_preset(preset), lowering=lowering)
        saved, grads = run(torch.compile(model, backend=backend))
        report = backend.report()
        trained = _trained_fidelity(family, preset, lowering, steps, dtype) if steps else None
        results.append(CoverageResult(family.name, preset, eager_bytes, saved, report.planned_bytes,
                                      gradient_fidelity(reference, grads), report.kept_by_reason(), steps, trained,
                                      dtype))
    torch._dynamo.reset()
    return results


def _trained_fidelity(family: Family, preset: str, lowering: str, steps: int, dtype: str) -> Fidelity:
    """A fresh copy trained ``steps`` AdamW steps under fxmem (a new batch each), then its LoRA gradients on the
    first batch against eager's at the same weights."""
    torch._dynamo.reset()
    model, first = build(family, dtype)
    prepare_peft(model)
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
