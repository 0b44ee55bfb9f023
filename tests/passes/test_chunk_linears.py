import functools

import torch

import fxmem
from fxmem.analysis.roles import Role
from tests.conftest import (
    assert_matches_eager,
    loss_and_grads,
    pass_summary,
    randomize_lora_b,
    tiny_model,
    worst_cosine,
)
from tests.test_whatif import wide_bf16_transient

_summary = functools.partial(pass_summary, name="chunk_linears")


def test_the_attention_projections_run_in_chunks_with_the_gradients_of_eager():
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", linear_chunk=12, mlp_chunk=12)
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    # per block: q, k and v read the normalized input, o the attention's output (the MLP's are chunk_mlp's)
    assert _summary(backend) == ("8 LoRA linear(s) in 4 op(s) of one input each (3, 1, 3, 1 linears), 32 tokens in "
                                 "chunks of 12: each group's input the only tensor it saves, its d x one buffer")
    assert_matches_eager(reference, loss, grads)


def test_without_chunked_mlps_the_mlps_linears_are_grouped_too():
    model, batch = tiny_model("llama", lora=True, layers=1)
    backend = fxmem.backend("exact", linear_chunk=12)
    loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert _summary(backend).startswith("7 LoRA linear(s) in 4 op(s) of one input each (3, 1, 2, 1 linears)")


def test_linears_whose_adapters_differ_in_dtype_run_one_op_each():
    model, batch = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    q_proj.lora_A.default.to(torch.float64)
    q_proj.lora_B.default.to(torch.float64)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", linear_chunk=12, mlp_chunk=12)
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    # the op casts x to one adapter dtype: q, k and v are not one group
    assert _summary(backend).startswith("4 LoRA linear(s) in 4 op(s) of one input each (1, 1, 1, 1 linears)")
    assert_matches_eager(reference, loss, grads)


def test_under_autocast_the_linears_are_left_whole_and_the_report_says_why():
    model, batch = tiny_model("llama", lora=True, layers=1)
    backend = fxmem.backend("exact", linear_chunk=12, mlp_chunk=12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    # all seven: the MLP, its output bf16 from a float32 input, is not chunked either
    assert _summary(backend) == ("no PEFT LoRA linear (no dropout) on a frozen weight (float, or bitsandbytes 4-bit: "
                                 "dequantize_bases), outside a chunked MLP; 7 LoRA linear(s) left whole, their output "
                                 "or base weight in another dtype than their input (as under autocast)")


def test_linears_with_lora_dropout_are_left_as_torch_runs_them():
    model, batch = tiny_model("llama", lora=True, layers=1, lora_dropout=0.1)
    backend = fxmem.backend("exact", linear_chunk=8)
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == ("no PEFT LoRA linear (no dropout) on a frozen weight (float, or bitsandbytes 4-bit: "
                                 "dequantize_bases), outside a chunked MLP")


def test_a_bf16_block_checkpointed_with_its_linears_in_chunks_keeps_the_gradients_of_torch_compile():
    model, batch = tiny_model("llama", lora=True, layers=1, dtype=torch.bfloat16)
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    options = {"norm_chunk": 12, "mlp_chunk": 12, "block_checkpoint": True}
    backend = fxmem.backend("exact", linear_chunk=12, **options)
    _, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert _summary(backend).startswith("4 LoRA linear(s) in 2 op(s)")
    # torch.compile's own bf16 gradients are 0.99987 from eager's (tests/passes/test_chunk_norm.py)
    assert worst_cosine(reference[1], grads) > 0.9995


def test_the_linears_save_only_their_inputs():
    model, batch = tiny_model("llama", lora=True, layers=1)

    def saved(config):
        [region] = fxmem.inspect(model, **batch, config=config).regions
        return [(s.role, s.detail, s.nbytes) for s in region.saved if s.nbytes and s.role is not Role.PARAMETER]

    whole = saved(fxmem.Config(return_logits=False, mlp_chunk=8))
    chunked = saved(fxmem.Config(return_logits=False, mlp_chunk=8, linear_chunk=8))
    assert [d for r, d, _ in chunked if r is Role.LINEAR_INPUT] == ["chunked LoRA linears: q_proj and 2 more",
                                                                    "chunked MLP: gate_proj, up_proj"]
    # o_proj's input is the attention's output, which SDPA's backward saves anyway; no rank-wide x A^T is saved
    # (the op makes it again from its input): four fewer, of 32 tokens x rank 8 in float32
    assert [r for r, _, _ in whole].count(Role.LORA_INTERMEDIATE) == 4
    assert Role.LORA_INTERMEDIATE not in {r for r, _, _ in chunked}
    assert sum(n for *_, n in chunked) == sum(n for *_, n in whole) - 4 * 32 * 8 * 4


def test_a_recomputed_bf16_block_holds_less_at_its_peak(tmp_path):
    # traced on fake tensors as whatif traces, with the MLP and the norms already in chunks: the projections'
    # backward then sets the peak
    options = {"mlp_chunk": 256, "norm_chunk": 256, "block_checkpoint": True, "return_logits": False}
    whole = wide_bf16_transient(tmp_path, fxmem.Config(**options))
    chunked = wide_bf16_transient(tmp_path, fxmem.Config(linear_chunk=256, **options))
    hidden_wide_bf16 = 4096 * 256 * 2
    # measured, as inductor runs the graphs: 12.6 and 8.4 bf16 rows of the hidden width
    assert whole - chunked >= 4 * hidden_wide_bf16


def test_a_linear_reading_another_ones_output_reads_its_chunked_op():
    # two stacked LoRA linears: the second group's input is the first group's output, rewritten before it
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    stack = torch.nn.Sequential(torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8, bias=False))
    model = get_peft_model(stack, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "1"], init_lora_weights=False))
    x = torch.randn(2, 10, 16)

    def grads(forward):
        forward(x).square().sum().backward()
        found = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad(set_to_none=True)
        return found

    reference = grads(model)
    backend = fxmem.backend("exact", linear_chunk=7)
    chunked = grads(torch.compile(model, backend=backend))
    assert _summary(backend).startswith("2 LoRA linear(s) in 2 op(s) of one input each (1, 1 linears)")
    for name, ref in reference.items():
        assert float((chunked[name] - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), name
    # the first linear's own products are gone, not run beside its op (they would save its x A^T)
    [region] = fxmem.inspect(model, x, config=fxmem.Config(linear_chunk=7)).regions
    assert [s.role for s in region.saved if s.role is not Role.PARAMETER] == [Role.INPUT_VIEW, Role.LINEAR_INPUT]
