"""lora_reorder (HyC-LoRA inter-operator): what is saved instead of LoRA outputs, and the gradients it gives."""

import torch

import fxmem
from fxmem.analysis import Role
from fxmem.cost_model.plan import Action
from fxmem.measure import gradient_fidelity
from tests.conftest import compiled_step, loss_and_grads, randomize_lora_b, tiny_model


def _saved_rows(backend):
    return [(s, p) for _, s, p in backend.report().rows() if s.nbytes > 0]


def _summary(backend, name="lora_reorder"):
    return {p.name: p.note for p in backend.regions[0].passes}[name]


def test_llama_saves_x_w_quantized_and_x_a_exact_instead_of_the_mlp_and_qkv_outputs():
    model, batch = tiny_model("llama", lora=True)
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", rebuild_from_x=False), lowering="eager")
    saved, _, _ = compiled_step(model, batch, backend)
    assert saved == backend.report().planned_bytes
    assert _summary(backend).startswith("10 LoRA output(s) rebuilt in backward from x W and x A "
                                        "(2x k, 2x product, 2x q, 2x silu, 2x v)")
    assert "4 feeding no activation, Hadamard product or fused attention left as is" in _summary(backend)
    rows = _saved_rows(backend)
    rebuilt = [(s, p) for s, p in rows if s.role is Role.LORA_BASE_OUTPUT]
    assert sorted(s.detail.removeprefix("output rebuilt for ") for s, _ in rebuilt) == sorted(
        ["q", "k", "v", "silu", "product"] * 2)
    # x W at bits (q, k and v at qkv_bits), x A exact; SiLU's input and output, up, the product and q/k after RoPE
    # are not saved at all.
    assert all(p.action is Action.QUANTIZE and p.bits == (8 if s.detail[-1] in "qkv" else 2) for s, p in rebuilt)
    assert all(p.action is Action.KEEP for s, p in rows if s.role is Role.LORA_INTERMEDIATE)
    assert not [s for s, _ in rows if s.role in (Role.ACT_INPUT, Role.PRODUCT_INPUT, Role.ATTN_QKV)]
    # What down_proj reads (the product) is no longer a saved linear input: only the norm outputs are.
    widths = {s.shape[-1] for s, _ in rows if s.role is Role.LINEAR_INPUT}
    assert widths == {64}


def test_inter_improves_gradient_fidelity_over_intra_at_equal_bits_and_honours_the_lora_scaling():
    model, batch = tiny_model("llama", lora=True)  # lora_alpha 32, r 8: scaling 4
    randomize_lora_b(model)
    _, _, exact = compiled_step(model, batch, fxmem.Backend(lowering="eager"))
    cosine = {}
    for name, overrides in [("intra", {"lora_reorder": False}), ("intra+inter", {}),
                            ("inter 8-bit", {"bits": 8, "intra": False})]:
        torch._dynamo.reset()
        config = fxmem.Config.from_preset("hyclora-2bit", **overrides)
        _, _, grads = compiled_step(model, batch, fxmem.Backend(config, lowering="eager"))
        cosine[name] = gradient_fidelity(exact, grads).min_cosine
    assert cosine["intra+inter"] > cosine["intra"] + 0.02, cosine
    assert cosine["inter 8-bit"] > 0.9995, cosine  # only x W is rounded, to 8 bits: a wrong rebuild would show


def test_bert_gelu_ffn_and_qkv_are_rebuilt_and_the_gradients_hold():
    model, batch = tiny_model("bert", lora=True)
    randomize_lora_b(model)
    _, exact_loss, exact = compiled_step(model, batch, fxmem.Backend(lowering="eager"))
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=8, lora_reorder=True, intra=False), lowering="eager")
    _, loss, grads = compiled_step(model, batch, backend)
    # eager attention here (attention dropout): q/k reach the softmax through matmuls; tanh: the pooler
    assert _summary(backend).startswith("9 LoRA output(s) rebuilt in backward from x W and x A "
                                        "(2x gelu, 2x k, 2x q, 1x tanh, 2x v)")
    assert torch.equal(loss, exact_loss)  # same dropout masks: the forward is untouched
    assert gradient_fidelity(exact, grads).min_cosine > 0.999


def test_lora_dropout_layers_are_rebuilt_like_the_others():
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1, layers=1)
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit"), lowering="eager")
    forward = torch.compile(model, backend=backend)
    loss, grads = loss_and_grads(forward, model, batch)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert _summary(backend).startswith("5 LoRA output(s) rebuilt in backward from x W and x A")
    assert len([s for s, _ in _saved_rows(backend) if s.role is Role.LORA_BASE_OUTPUT]) == 5


def test_runlora_leaves_the_rebuilt_layers_to_lora_reorder_and_gradients_still_match():
    model, batch = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    _, _, exact = compiled_step(model, batch, fxmem.Backend(lowering="eager"))
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config(bits=8, lora_reorder=True, intra=False, runlora="flops"), lowering="eager")
    _, _, grads = compiled_step(model, batch, backend)
    runlora = _summary(backend, "runlora")
    assert runlora.startswith("2 LoRA linear(s) reordered")  # o_proj and down_proj
    assert runlora.count("output rebuilt in backward by lora_reorder") == 5
    assert gradient_fidelity(exact, grads).min_cosine > 0.9995


def test_below_8_bits_gelu_and_tanh_outputs_keep_torchs_saved_derivative():
    model, batch = tiny_model("bert", lora=True, layers=1)
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", rebuild_from_x=False), lowering="eager")
    compiled_step(model, batch, backend)
    summary = _summary(backend)
    assert summary.startswith("3 LoRA output(s) rebuilt in backward from x W and x A (1x k, 1x q, 1x v)"), summary
    assert ("1 feeding gelu left as is: at 2 bits the saved gelu derivative is more faithful than a rebuilt "
            "input") in summary
    assert "1 feeding tanh left as is" in summary  # the pooler
    details = {s.detail for s, _ in _saved_rows(backend) if s.role is Role.LORA_BASE_OUTPUT}
    assert details == {"output rebuilt for q", "output rebuilt for k", "output rebuilt for v"}
    assert "gelu derivative" in {s.detail for s, _ in _saved_rows(backend) if s.role is Role.ACT_INPUT}


def test_rebuild_from_x_rebuilds_gelu_from_a_replayed_x_w_never_a_coarse_one():
    model, batch = tiny_model("bert", lora=True, layers=1)
    randomize_lora_b(model)
    _, _, exact = compiled_step(model, batch, fxmem.Backend(lowering="eager"))
    torch._dynamo.reset()
    # attention's probabilities kept whole: at 16 tokens the preset's pruning keeps 1 per row, and would be all
    # that the gradient shows
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", attn_sparsity=None), lowering="eager")
    saved, _, grads = compiled_step(model, batch, backend)
    assert saved == backend.report().planned_bytes
    assert _summary(backend).startswith("5 LoRA output(s) rebuilt in backward from x W and x A "
                                        "(1x gelu, 1x k, 1x q, 1x tanh, 1x v)")
    plans = {s.detail.removeprefix("output rebuilt for "): p for s, p in _saved_rows(backend)
             if s.role is Role.LORA_BASE_OUTPUT}
    # GELU's X W is replayed from the 8-bit x; the pooler's tanh X W (one token per sequence) is too small to shrink
    assert plans["gelu"].action is Action.RECOMPUTE and plans["gelu"].reason.startswith("rebuilt in backward as x W^T")
    assert plans["tanh"].action is Action.KEEP
    assert not [s for s, _ in _saved_rows(backend) if s.role is Role.ACT_INPUT]  # no GELU derivative saved
    torch._dynamo.reset()
    paper = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", attn_sparsity=None, rebuild_from_x=False),
                          lowering="eager")
    paper_saved, _, paper_grads = compiled_step(model, batch, paper)
    assert saved < paper_saved
    # the worst: the embeddings' output, at linear_input_bits (4), read by q/k/v's LoRA A
    assert gradient_fidelity(exact, grads).min_cosine > max(0.995, gradient_fidelity(exact, paper_grads).min_cosine)


def test_an_x_that_x_w_is_replayed_from_stays_quantized_beside_lowrank():
    # With lowrank on too, the second partition's planning would factor x (fewer bytes than 8-bit codes), and the
    # replayed matmul would read factors: a replay source is quantized at 8 bits in both partitions.
    # 128 rows of 64 channels: x's 4-bit codes (the first planning) are fewer bytes than rank-8 factors, its 8-bit
    # codes more
    model, _ = tiny_model("llama", lora=True, layers=1)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", lowrank=0.125), lowering="eager")
    saved, _, _ = compiled_step(model, batch, backend)
    assert saved == backend.report().planned_bytes
    rows = _saved_rows(backend)
    assert sum(p.action is Action.RECOMPUTE for s, p in rows if s.role is Role.LORA_BASE_OUTPUT) == 2
    source = next(p for s, p in rows if s.module.endswith("post_attention_layernorm") and s.role is Role.LINEAR_INPUT)
    assert (source.action, source.bits) == ("quantize", 8), source


def test_rebuild_refusal_depends_on_the_activation_and_the_bits():
    from fxmem.cost_model.options import rebuild_refusal
    for bits in (2, 4):
        assert rebuild_refusal("gelu", fxmem.Config(bits=bits)) is not None
        assert rebuild_refusal("tanh", fxmem.Config(bits=bits)) is not None
        assert rebuild_refusal("relu", fxmem.Config(bits=bits)) is not None
        for kind in ("silu", "product", "q", "v"):
            assert rebuild_refusal(kind, fxmem.Config(bits=bits)) is None
    assert rebuild_refusal("gelu", fxmem.Config(bits=8)) is None
    assert rebuild_refusal("gelu", fxmem.Config(bits=2, lora_reorder=True, rebuild_from_x=True)) is None
    # memory_budget plans from nothing compressed: no x is raised for a replay, so GELU keeps its derivative
    assert rebuild_refusal("gelu", fxmem.Config(bits=2, lora_reorder=True, rebuild_from_x=True,
                                                memory_budget=0.5)) is not None


def test_rebuild_from_x_replays_x_w_below_8_bits_and_norm_inputs_from_x_at_8_bits():
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    _, _, exact = compiled_step(model, batch, fxmem.Backend(lowering="eager"))
    results = {}
    for replay in (False, True):
        torch._dynamo.reset()
        backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", rebuild_from_x=replay),
                                lowering="eager")
        saved, _, grads = compiled_step(model, batch, backend)
        assert saved == backend.report().planned_bytes
        results[replay] = saved, gradient_fidelity(exact, grads).min_cosine
    rows = _saved_rows(backend)
    plans = {s.detail.removeprefix("output rebuilt for "): p for s, p in rows if s.role is Role.LORA_BASE_OUTPUT}
    # SwiGLU's X W (2 bits) are replayed from their layer's x; q, k and v's (qkv_bits: 8) stay quantized
    assert sorted(plans) == ["k", "product", "q", "silu", "v"]
    assert all(plans[kind].action is Action.QUANTIZE and plans[kind].bits == 8 for kind in "qkv")
    replayed = [p for s, p in rows if s.role is Role.LORA_BASE_OUTPUT and p.action is Action.RECOMPUTE]
    assert len(replayed) == 4 and all(p.nbytes == 0 and p.seconds > 0 for p in replayed)
    assert all(p.reason.startswith("rebuilt in backward as x W^T from ") and "a matmul" in p.reason
               for p in replayed)
    inputs = {s.module.split("layers.")[1]: p for s, p in rows if s.role is Role.LINEAR_INPUT}
    for layer in "01":
        assert inputs[f"{layer}.post_attention_layernorm"].bits == 8
        assert inputs[f"{layer}.post_attention_layernorm"].reason.endswith("; an X W rebuilt from it in backward")
    # the attention inputs, which the q/k/v projections read, are at qkv_bits
    assert inputs["1.input_layernorm"].bits == inputs["0.input_layernorm"].bits == 8
    # the final norm's input stays exact: it is the logits' (loss input)
    norms = [p for s, p in rows if s.role is Role.NORM_INPUT]
    assert [p.action for p in norms] == ["prenorm"] * 3 + ["keep"]
    assert all(p.bits == 8 and "8-bit codes" in p.reason and p.nbytes < 200 for p in norms[:3])
    assert results[True][0] < results[False][0] and results[True][1] > results[False][1] + 0.01, results
    # with qkv_bits=None, the attention inputs are raised to 8 bits as rebuild sources: q, k and v's X W, at 2
    # bits, are replayed from them
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-2bit", qkv_bits=None), lowering="eager")
    compiled_step(model, batch, backend)
    inputs = {s.module.split("layers.")[1]: p for s, p in _saved_rows(backend) if s.role is Role.LINEAR_INPUT}
    assert all(inputs[f"{layer}.input_layernorm"].bits == 8 and inputs[f"{layer}.input_layernorm"].reason.endswith(
        "; an X W rebuilt from it in backward") for layer in "01")
