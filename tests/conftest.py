import os

import torch

# Triton kernels run interpreted on CPU tensors (checked against their torch references); read when
# fxmem's kernels are defined, so before fxmem is imported. A CUDA machine runs them for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite runs in strict mode: any fallback, rollback or unsupported pattern fails the test that meets it
# (fxmem/fallback.py), unless the test asks for the fallback (the fixture lenient).
os.environ.setdefault("FXMEM_STRICT", "1")

import pytest

from fxmem.measure import model_tensors, saved_activation_bytes


@pytest.fixture
def lenient(monkeypatch):
    """Strict mode off (the suite runs with FXMEM_STRICT=1): for the tests of a fallback itself."""
    monkeypatch.setenv("FXMEM_STRICT", "0")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Each test compiles new models of the same classes: without a reset they would pile up
    # against dynamo's recompile limit and silently fall back to eager.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model(family: str, *, lora: bool, attn: str = "sdpa", seed: int = 0, lora_dropout: float = 0.0,
               layers: int = 2, kv_heads: int = 4, dtype: torch.dtype = torch.float32):
    """A small transformers model (random weights) and a batch for it; ``kv_heads`` < 4: Llama with GQA. In
    ``dtype``; PEFT then keeps the adapters in fp32 (its default, ``autocast_adapter_dtype``)."""
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 256, (2, 16), generator=generator)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(
            hidden_size=64, intermediate_size=172, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=kv_heads, vocab_size=256, attn_implementation=attn, use_cache=False))
        batch, targets = {"input_ids": ids, "labels": ids}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]
    elif family == "gemma":  # RMSNorm scaling by 1 + weight, GeGLU, embeddings scaled by sqrt(hidden)
        from transformers import GemmaConfig, GemmaForCausalLM
        model = GemmaForCausalLM(GemmaConfig(
            hidden_size=64, intermediate_size=172, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, vocab_size=256, attn_implementation=attn, use_cache=False))
        batch, targets = {"input_ids": ids, "labels": ids}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]
    elif family == "qwen3":  # an RMSNorm over each head of q and k, before RoPE
        from transformers import Qwen3Config, Qwen3ForCausalLM
        model = Qwen3ForCausalLM(Qwen3Config(
            hidden_size=64, intermediate_size=172, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=kv_heads, head_dim=16, vocab_size=256, attn_implementation=attn, use_cache=False))
        batch, targets = {"input_ids": ids, "labels": ids}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"]
    elif family == "opt":  # LayerNorms over the residual flattened to rows before the MLP, learned positions
        from transformers import OPTConfig, OPTForCausalLM
        model = OPTForCausalLM(OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=layers, num_attention_heads=4, word_embed_proj_dim=64,
            vocab_size=256, max_position_embeddings=64, dropout=0.0, attn_implementation=attn, use_cache=False))
        batch, targets = {"input_ids": ids, "labels": ids}, ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    elif family == "mixtral":  # a top-2 router over 4 experts; PEFT's "all-linear" adapts the router and experts
        from transformers import MixtralConfig, MixtralForCausalLM
        model = MixtralForCausalLM(MixtralConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=kv_heads, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
            attn_implementation=attn, use_cache=False))
        batch, targets = {"input_ids": ids, "labels": ids}, "all-linear"
    elif family == "bert":
        model = BertForSequenceClassification(BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4, vocab_size=256))
        batch = {"input_ids": ids, "labels": torch.randint(0, 2, (2,), generator=generator)}
        targets = ["query", "key", "value", "dense"]
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=256, use_cache=False,
                                           bos_token_id=0, eos_token_id=0))
        model.loss_type = "ForCausalLM"  # avoids the graph break on a warning_once in the loss lookup
        batch, targets = {"input_ids": ids, "labels": ids}, ["c_attn", "c_proj", "c_fc"]
    else:
        raise ValueError(family)
    model.to(dtype)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=32, target_modules=targets,
                                                 lora_dropout=lora_dropout, fan_in_fan_out=family == "gpt2"))
    model.train()
    return model, batch


def train_at_sequence_lengths(forward, model, lengths) -> None:
    """One training step per sequence length (batch 2, random ids); the loss and every gradient stay finite."""
    for seq in lengths:
        ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seq))
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()


def loss_and_grads(forward, model, batch, seed: int = 0):
    torch.manual_seed(seed)  # the same dropout draws for every run
    loss = forward(**batch).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_matches_eager(reference, loss, grads) -> None:
    """``loss`` within 1e-6 of eager's, and every gradient within 1e-5 of its largest value: float rounding."""
    assert torch.allclose(loss, reference[0], rtol=1e-6, atol=0)
    for name, ref in reference[1].items():
        assert float((grads[name] - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name


def pass_summary(backend, name: str) -> str:
    """What the pass ``name`` reported in each region the backend compiled, joined."""
    return "; ".join(p.note for r in backend.regions for p in r.passes if p.name == name)


def worst_cosine(reference_grads, grads) -> float:
    """The lowest cosine of any gradient against the reference's, in float32."""
    return min(float(torch.nn.functional.cosine_similarity(grads[k].flatten().float(), ref.flatten().float(), 0))
               for k, ref in reference_grads.items())


def randomize_lora_b(model):
    # PEFT starts B at zero, where A's gradient is zero too: nothing to compare.
    generator = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def compiled_step(model, batch, backend, steps=1):
    """Saved bytes, loss and gradients of the last of ``steps`` training steps of ``model`` under ``backend``."""
    forward = torch.compile(model, backend=backend)
    for _ in range(steps - 1):
        loss_and_grads(forward, model, batch)
    saved, _ = saved_activation_bytes(lambda: forward(**batch), model_tensors(model) + list(batch.values()))
    loss, grads = loss_and_grads(forward, model, batch)
    return saved, loss, grads
