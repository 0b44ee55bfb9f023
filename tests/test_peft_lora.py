"""PEFT's LoRA on routers and experts (fxmem.prepare_peft): PEFT's gradients, one compiled frame, no merged
expert weight saved; and the grouped LoRA op against a per-expert reference."""

import json

import pytest
import torch
from torch._dynamo.utils import counters

import fxmem
from fxmem.analysis import Role
from fxmem.cost_model.plan import Action
from fxmem.kernels import grouped_lora as kernel
from fxmem.kernels.grouped_lora import grouped_lora
from fxmem.kernels.runlora import SPLIT_DX_BACKWARD_ORDERS
from fxmem.models import hf_config
from fxmem.peft_lora import _experts_order, _factors
from fxmem.whatif import traced_activation_bytes
from tests.conftest import randomize_lora_b, tiny_model


def _gradients(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _wrappers(model):
    from peft.tuners.lora.layer import ParamWrapper
    return [m for m in model.modules() if isinstance(m, ParamWrapper)]


def test_prepared_experts_and_router_give_pefts_gradients():
    model, batch = tiny_model("mixtral", lora=True, layers=1)
    randomize_lora_b(model)
    loss, peft = _gradients(model, batch)
    prepared = fxmem.prepare_peft(model)
    assert prepared == ["base_model.model.model.layers.0.mlp.gate", "base_model.model.model.layers.0.mlp.experts"]
    assert fxmem.prepare_peft(model) == []  # once is enough
    prepared_loss, grads = _gradients(model, batch)
    assert torch.allclose(prepared_loss, loss, rtol=1e-6)
    assert len(grads) == len(peft) == 14  # attention's 4 LoRA linears, the router's and 2 expert weights' A and B
    for name, grad in grads.items():
        assert (grad - peft[name]).abs().max() <= 1e-5 * peft[name].abs().max(), name


def test_the_experts_run_in_chunks_of_mlp_chunk_with_pefts_gradients():
    model, batch = tiny_model("mixtral", lora=True, layers=1)  # 32 tokens
    randomize_lora_b(model)
    loss, peft = _gradients(model, batch)
    config = fxmem.Config.from_preset("hyclora-4bit", mlp_chunk=12)
    fxmem.prepare_peft(model, config)
    assert {m.fxmem_mlp_chunk for m in _wrappers(model) if hasattr(m, "fxmem_mlp_chunk")} == {12}
    chunked_loss, grads = _gradients(model, batch)
    assert torch.allclose(chunked_loss, loss, rtol=1e-6)
    for name, grad in grads.items():
        assert (grad - peft[name]).abs().max() <= 1e-5 * peft[name].abs().max(), name
    # compiled: three chunks, each with its gate-up and down products replayed in backward from the 8-bit input
    report = fxmem.inspect(model, **batch, config=config, guard=False)
    replays = [p for _, s, p in report.rows() if p.action is Action.RECOMPUTE and "by the experts' products" in p.reason]
    assert len(replays) == 2 * 3

    def chunks():
        return {m.fxmem_mlp_chunk for m in _wrappers(model) if hasattr(m, "fxmem_mlp_chunk")}

    torch._dynamo.reset()
    fxmem.inspect(model, **batch)  # another config, for the inspection alone: the chunks set before stay after
    fxmem.prepare_peft(model)  # no config: they stay
    assert chunks() == {12}
    fxmem.prepare_peft(model, fxmem.Config())  # prepared for another config: the experts whole again
    assert chunks() == {None}


def test_experts_in_chunks_hold_less_at_backwards_peak(tmp_path):
    from tests.test_whatif import TINY_QWEN3_MOE
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_QWEN3_MOE))

    def traced(chunk):
        return traced_activation_bytes(hf_config(str(path)), layers=1, rank=8, dtype=torch.float32, batch=1, seq=1024,
                                       preset=fxmem.Config.from_preset("hyclora-4bit", mlp_chunk=chunk,
                                                                       return_logits=False))

    whole, chunked = traced(None), traced(128)
    assert chunked.saved == pytest.approx(whole.saved, rel=0.001)  # and each chunk's routing: 1 KiB more
    # the routed rows, their products and gradients of 1,024 tokens x top-2, 128 at a time: 1.70 MiB against 6.46
    assert chunked.backward_peak < 0.3 * whole.backward_peak
    assert chunked.forward_transient < 0.3 * whole.forward_transient


def test_peft_runs_its_own_forward_where_the_adapters_are_disabled():
    model, batch = tiny_model("mixtral", lora=True, layers=1)
    randomize_lora_b(model)
    with model.disable_adapter():
        base = model(**batch).loss
    fxmem.prepare_peft(model)
    with model.disable_adapter():
        assert torch.equal(model(**batch).loss, base)
    assert not torch.equal(model(**batch).loss, base)  # B past init: the adapters change the loss


def test_the_factors_are_pefts_without_a_copy():
    model, _ = tiny_model("mixtral", lora=True, layers=1)
    experts = [w for w in _wrappers(model) if w.num_experts > 1]
    assert len(experts) == 2
    for wrapper in experts:
        lhs, rhs, scaling = _factors(wrapper)
        peft_lhs, peft_rhs, peft_scaling = wrapper.get_delta_factors("default")
        assert torch.equal(lhs, peft_lhs) and torch.equal(rhs, peft_rhs) and scaling == peft_scaling
        assert lhs.untyped_storage().data_ptr() in {p.untyped_storage().data_ptr() for p in wrapper.parameters()}


def test_a_prepared_mixture_of_experts_compiles_once_and_saves_no_merged_expert_weight():
    # PEFT registers a parametrization at every forward: a new module class each time, so dynamo recompiled the
    # experts and router at every step, and autograd kept every expert's merged weight W + s lhs rhs.
    model, batch = tiny_model("mixtral", lora=True, layers=1)
    fxmem.prepare_peft(model)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    for _ in range(3):
        compiled(**batch).loss.backward()
    assert counters["frames"]["total"] == 1
    assert not counters["graph_break"]
    torch._dynamo.reset()
    report = fxmem.inspect(model, **batch, config=fxmem.Config.from_preset("hyclora-4bit"), guard=False)
    rows = [(s, p) for _, s, p in report.rows() if s.nbytes]
    experts = model.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    weight_sizes = {experts.gate_up_proj.numel(), experts.down_proj.numel()}
    assert not [s for s, _ in rows if torch.Size(s.shape).numel() in weight_sizes]
    inputs = {(s.detail, s.shape): p for s, p in rows if s.role is Role.LINEAR_INPUT}
    # The router's input (multiplied by PEFT's merged router weight, no parameter itself) at 8 bits, and the experts'
    # up and down projections' inputs (2 x 16 tokens, each routed to 2 experts) rebuilt in backward: the routed rows
    # gathered again from the router's input, the down projection's input from the activation's
    router_input = inputs["gate", (2, 16, 64)]
    assert (router_input.action, router_input.bits) == ("quantize", 8)
    assert inputs["experts", (64, 64)].action == inputs["experts", (64, 128)].action is Action.RECOMPUTE
    # the activation's input and the experts' output (held only for the routing weights' gradient): rebuilt in
    # backward by the experts' products from the router's 8-bit input, as a dense X W is replayed from its x
    products = {s.role: p for s, p in rows if s.role in (Role.ACT_INPUT, Role.ROW_SCALED)}
    assert set(products) == {Role.ACT_INPUT, Role.ROW_SCALED}
    assert all(p.action is Action.RECOMPUTE and "by the experts' products" in p.reason for p in products.values())
    # without rebuild_from_x the experts' output is stored at its floor of 4 bits, and at no fewer under 2 bits
    for preset in ("hyclora-4bit", "hyclora-2bit"):
        config = fxmem.Config.from_preset(preset, rebuild_from_x=False)
        report = fxmem.inspect(model, **batch, config=config, guard=False)
        (scaled,) = [(s, p) for _, s, p in report.rows() if s.nbytes and s.role is Role.ROW_SCALED]
        assert (scaled[0].shape, scaled[1].action, scaled[1].bits) == ((64, 64), "quantize", 4), preset


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
def test_grouped_lora_matches_a_per_expert_reference(dtypes):
    x_dtype, factor_dtype = dtypes
    generator = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 2]  # an expert with no rows
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    x = torch.randn(sum(counts), 6, generator=generator).to(x_dtype).requires_grad_()
    a = torch.randn(4, 6, 2, generator=generator).to(factor_dtype).requires_grad_()
    b = torch.randn(2, 5, 4, generator=generator).to(factor_dtype).permute(2, 0, 1).detach().requires_grad_()
    grad = torch.randn(sum(counts), 5, generator=generator)

    out = grouped_lora(x, a, b, offsets)
    assert out.dtype == factor_dtype
    out.backward(grad.to(out.dtype))
    got = (out.detach(), x.grad, a.grad, b.grad)
    for tensor in (x, a, b):
        tensor.grad = None
    starts = [0, *offsets.tolist()[:-1]]
    reference = torch.cat([x[s:s + n].to(factor_dtype) @ a[e] @ b[e] for e, (s, n) in enumerate(zip(starts, counts))])
    reference.backward(grad.to(reference.dtype))
    tolerance = 1e-5 if x_dtype == torch.float32 else 1e-2
    for mine, theirs in zip(got, (reference.detach(), x.grad, a.grad, b.grad), strict=True):
        assert mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance)
    assert not a.grad[1].any()  # the expert with no rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", SPLIT_DX_BACKWARD_ORDERS)
def test_grouped_lora_fast_path_matches_the_reference(dtype, order):
    generator = torch.Generator().manual_seed(1)
    offsets = torch.tensor([5, 5, 12, 20], dtype=torch.int32)  # expert 1 has no rows
    x, grad = torch.randn(20, 32, generator=generator).to(dtype), torch.randn(20, 16, generator=generator).to(dtype)
    a = torch.randn(4, 32, 8, generator=generator).to(dtype)
    b = torch.randn(8, 16, 4, generator=generator).to(dtype).permute(2, 0, 1)  # PEFT's layout: a strided view
    assert kernel.grouped_mm_dtype(x, a, b, offsets) == dtype
    assert kernel.grouped_mm_dtype(x, a[:, :, :3], b[:, :3], offsets) is None  # rows of 3 values: not aligned
    assert kernel.grouped_mm_dtype(x, a, b, offsets.long()) is None
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(torch.ops.fxmem.grouped_lora(x, a, b, offsets),
                               kernel.grouped_lora_reference(x, a, b, offsets), **tolerance)
    fast = torch.ops.fxmem.grouped_lora_backward(x, a, b, offsets, grad, order)
    reference = kernel.grouped_lora_backward_reference(x, a, b, offsets, grad, order)
    for mine, theirs in zip(fast, reference, strict=True):
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype and mine.is_contiguous()
        torch.testing.assert_close(mine, theirs, **tolerance)
    assert not fast[1][1].any() and not fast[2][1].any()  # no rows, no gradient


@pytest.mark.parametrize("order", SPLIT_DX_BACKWARD_ORDERS)
def test_every_grouped_backward_order_gives_the_same_gradients(order):
    generator = torch.Generator().manual_seed(2)
    offsets = torch.tensor([8, 8, 24], dtype=torch.int32)  # an expert with no rows
    x, grad = torch.randn(24, 16, generator=generator), torch.randn(24, 32, generator=generator)
    a, b = torch.randn(3, 16, 8, generator=generator), torch.randn(3, 8, 32, generator=generator)
    assert kernel.grouped_mm_dtype(x, a, b, offsets) == torch.float32  # the fast path runs
    expected = kernel.grouped_lora_backward_reference(x, a, b, offsets, grad, "backward1")
    for path in (torch.ops.fxmem.grouped_lora_backward, kernel.grouped_lora_backward_reference):
        for mine, theirs in zip(path(x, a, b, offsets, grad, order), expected, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_grouped_lora_refuses_an_order_that_folds_the_adapter_into_the_weights():
    x, a, b = torch.randn(4, 8), torch.randn(2, 8, 2), torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="'backward4' is not one a grouped LoRA runs: valid orders.*"
                                         "backward1, backward2, backward3, backward6, or 'auto'"):
        torch.ops.fxmem.grouped_lora_backward(x, a, b, torch.tensor([2, 4], dtype=torch.int32), x, "backward4")


def test_autograd_runs_the_cost_models_order_for_the_rows_of_each_call(monkeypatch):
    # x^T dy per expert (in x out) beats the rank-r products only where in and out are small against the rank
    assert _experts_order(32, 8, 8, 16, torch.float32, torch.float32) == "backward3"
    assert _experts_order(2, 8, 8, 16, torch.float32, torch.float32) == "backward1"
    assert _experts_order(32, 64, 64, 8, torch.float32, torch.float32) == "backward1"
    assert kernel.choose_backward_order is _experts_order  # set by fxmem.peft_lora
    asked = []
    monkeypatch.setattr(kernel, "choose_backward_order", lambda *shape: asked.append(shape) or "backward3")

    def step(x, a, b, offsets):
        return grouped_lora(x, a, b, offsets).sum()

    x = torch.randn(40, 8, requires_grad=True)
    a, b = torch.randn(4, 8, 16, requires_grad=True), torch.randn(4, 16, 8, requires_grad=True)
    offsets = torch.tensor([10, 20, 30, 40], dtype=torch.int32)
    torch._dynamo.mark_dynamic(x, 0)  # decided when it runs: no graph break, no guard on the rows
    torch.compile(step, backend="aot_eager", fullgraph=True)(x, a, b, offsets).backward()
    assert asked == [(10, 8, 8, 16, torch.float32, torch.float32)]


def test_a_prepared_model_pickles():
    import io
    import pickle

    model, batch = tiny_model("mixtral", lora=True, layers=1)
    fxmem.prepare_peft(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert type(loaded.base_model.model.model.layers[0].mlp.experts).__name__ == "PreparedParamWrapper"
    assert torch.equal(loaded(**batch).loss, model(**batch).loss)
    assert pickle.loads(pickle.dumps(model)) is not None


def test_transposed_experts_with_biases_and_a_router_with_a_bias_give_pefts_gradients():
    # gpt-oss's experts store their weights (in, out) per expert, with a bias per expert and a clamped gate; PEFT's
    # "all-linear" leaves them, target_parameters adapts them
    from peft import LoraConfig, get_peft_model
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=256, use_cache=False,
        attn_implementation="eager", layer_types=["full_attention"]))
    for name, p in model.named_parameters():
        if name.endswith(("_bias", "router.bias")):
            torch.nn.init.normal_(p, std=0.1)  # zeros in the config's init: a bias must matter
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"], target_parameters=[
        "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"]))
    randomize_lora_b(model)
    experts = model.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    assert experts.is_transposed and experts.has_bias
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    loss, peft = _gradients(model, batch)
    assert len(fxmem.prepare_peft(model)) == 2  # the router, the experts
    prepared_loss, grads = _gradients(model, batch)
    assert torch.allclose(prepared_loss, loss, rtol=1e-6)
    assert len(grads) == len(peft) == 8  # q_proj's, the router's and the 2 expert weights' A and B
    for name, grad in grads.items():
        assert (grad - peft[name]).abs().max() <= 1e-5 * peft[name].abs().max(), name
