"""The values fxmem's options take, in plain Python: the modules that use them (kernels, config, whatif, models,
train) import them from here, and so does the `fxmem` command, which builds its parsers from them without importing
torch. A leaf: it imports nothing, so that `fxmem --help` and `import fxmem.config` stay fast."""

from __future__ import annotations

from typing import Any

BITS_CHOICES = (1, 2, 4, 8)  # the widths the packing supports (kernels/quantize.py): 8 // bits codes to a byte
BLOCK_INPUT_BITS_CHOICES = (4, 8)  # a checkpointed block's stored input, which the whole block is rebuilt from
# The options that run ops over chunks of tokens; each takes a number of tokens, or AUTO.
CHUNK_OPTIONS = ("mlp_chunk", "norm_chunk", "linear_chunk")
# What the chunk options and block_checkpoint take to be turned on where the step's predicted peak drops
# (cost_model/auto.py).
AUTO = "auto"


def check_lowrank(value: Any, *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``value`` is a rank ratio in (0, 1), an integer rank >= 1 (or None, if allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return
    if isinstance(value, float) and 0 < value < 1:
        return
    off = ", or None (off)" if allow_none else ""
    raise ValueError(f"lowrank must be a ratio in (0, 1) of the last dimension, an integer rank >= 1{off}; "
                     f"got {value!r}")


# whatif's dtypes, each the name of its torch dtype
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "sgd-momentum": 1}  # state tensors per trainable parameter
# "nf4": QLoRA, every LoRA-targeted linear's frozen weight stored as bitsandbytes' NF4 (double-quantized scales);
# the rest (embeddings, head, norms, adapters) in the model's dtype.
BASES = ("float", "nf4")
# whatif --max-context: the presets a long run would pick from, each with its loss chunked (return_logits=False: at
# long context the logits alone, tokens x vocabulary in float32, would outweigh every saved activation).
MAX_CONTEXT_PRESETS = ("exact", "hyclora-4bit", "hyclora-2bit")
CONTEXT_GRANULARITY = 1024

# Known shapes, built from their published dimensions (no download).
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000},
    "llama-13b": {"model_type": "llama", "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 40, "vocab_size": 32000},
    "mistral-7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "vocab_size": 32000, "sliding_window": None},
    "llama-3-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256},
    "roberta-base": {"model_type": "roberta", "hidden_size": 768, "intermediate_size": 3072,
                     "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 50265,
                     "max_position_embeddings": 514, "type_vocab_size": 1, "hidden_dropout_prob": 0.0,
                     "attention_probs_dropout_prob": 0.0},
    # mixtures of experts, from their published config.json (architectures: built as causal LMs)
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
                      "rope_theta": 1000000.0},
    "mixtral-8x7b": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "vocab_size": 32000, "sliding_window": None, "max_position_embeddings": 32768},
}

HIFT_ORDERS = ("bottom2up", "top2down", "random")  # the order HiFT walks the layer groups in (train/hift.py)
