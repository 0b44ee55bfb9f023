"""Tiny models and real text for the core tests, built on transformers and PEFT directly. The experiment harness
(fxmem_bench) keeps its own workloads; no test outside tests/bench imports it (tests/test_architecture.py)."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sysconfig
import tempfile
from typing import TYPE_CHECKING

import torch

from fxmem.models import LORA_TARGETS

if TYPE_CHECKING:
    from transformers import LlamaConfig

# Vendored or generated trees of the standard library, left out of its text (as the harness's fxmem_bench/data.py)
_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__", "encodings"})


@functools.cache
def stdlib_source(limit: int) -> bytes:
    """The first ``limit`` bytes of the Python standard library's own source, its files in path order: real text
    on every machine."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted((p for p in root.rglob("*.py") if not _SKIPPED_DIRS & set(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    chunks, total = [], 0
    for path in files:
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= limit:
            break
    return b"".join(chunks)[:limit]


def text_batch(batch: int, seq: int) -> dict[str, torch.Tensor]:
    """``batch`` rows of ``seq`` byte ids (0..255) of the standard library's source; the targets are the inputs."""
    ids = torch.frombuffer(bytearray(stdlib_source(batch * seq)), dtype=torch.uint8).long().view(batch, seq)
    return {"input_ids": ids, "labels": ids}


@dataclasses.dataclass(frozen=True)
class TinyLlama:
    """A tiny LlamaForCausalLM (seeded random weights, SDPA attention, no KV cache) with PEFT LoRA on every linear of
    every block, B drawn past PEFT's zeros, and a batch of real text: as the harness builds its Llama workloads."""

    hidden: int = 64
    ffn: int = 172
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    vocab: int = 256
    batch: int = 2
    seq: int = 32
    dtype: torch.dtype = torch.float32  # of the weights; PEFT keeps the adapters in fp32 on a bf16 model
    lora_rank: int = 16
    lora_alpha: int | None = None  # None: the rank (scaling 1)
    lora_b_std: float = 0.02  # with B = 0, A's gradient is zero: nothing to compare
    nf4: bool = False  # QLoRA: every LoRA-targeted linear a bitsandbytes NF4 Linear4bit, computing in ``dtype``

    def hf_config(self) -> LlamaConfig:
        from transformers import LlamaConfig
        return LlamaConfig(hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
                           attn_implementation="sdpa", use_cache=False)

    def base_model(self, seed: int = 0) -> torch.nn.Module:
        """The model without LoRA, its parameters in ``dtype`` (buffers keep theirs: RoPE's frequencies stay fp32)."""
        from transformers import LlamaForCausalLM
        torch.manual_seed(seed)
        model = LlamaForCausalLM(self.hf_config())
        for parameter in model.parameters():
            parameter.data = parameter.data.to(self.dtype)
        return _as_nf4_base(model, self.dtype) if self.nf4 else model

    def with_lora(self, model: torch.nn.Module, lora_dropout: float = 0.0) -> torch.nn.Module:
        """``model`` under LoRA (training mode), each B drawn from N(0, lora_b_std^2) by the global generator."""
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=self.lora_rank, lora_alpha=self.lora_alpha or self.lora_rank,
                                                 lora_dropout=lora_dropout, target_modules=LORA_TARGETS["llama"]))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, self.lora_b_std)
        return model.train()

    def build(self, seed: int = 0, lora_dropout: float = 0.0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The model with LoRA, and its batch."""
        return self.with_lora(self.base_model(seed), lora_dropout), text_batch(self.batch, self.seq)


def _as_nf4_base(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` as QLoRA users load and prepare theirs: from_pretrained with bitsandbytes' NF4 config (double
    quantization, compute in ``dtype``, the output layer kept) from a saved copy, then peft's
    prepare_model_for_kbit_training, without its gradient checkpointing."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from fxmem.kernels.nf4 import bitsandbytes
    bitsandbytes()  # its error if absent, and its import-time warning silenced
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["lm_head"])
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=nf4, dtype=dtype, device_map="cpu")
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


TINY_LLAMA = TinyLlama()
TINY_BF16 = TinyLlama(kv_heads=2, dtype=torch.bfloat16, lora_alpha=32)  # grouped-query attention, fp32 adapters
TINY_QLORA = TinyLlama(nf4=True)  # on an NF4 base
# The guard's tiny Llama (the harness's coverage model): hidden 128, grouped-query attention, LoRA r=8 at 128 tokens
GUARD_LLAMA = TinyLlama(hidden=128, ffn=256, kv_heads=2, seq=128, lora_rank=8)
