"""recompute_adapter_cast: PEFT's fp32 adapters on a bf16 model, partitioned as if the adapters had x's dtype."""

import torch

from fxmem import Backend, Config
from fxmem.measure import saved_activation_bytes
from fxmem.passes import PassManager
from fxmem.techniques import default_passes
from tests.conftest import randomize_lora_b, tiny_model


def _bf16_model(adapters: torch.dtype):
    model, batch = tiny_model("llama", lora=True, dtype=torch.bfloat16, kv_heads=2)  # PEFT: fp32 adapters
    randomize_lora_b(model)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.to(adapters)
    return model, batch


def _compiled(model, batch, config, lowering="eager", passes=None):
    torch._dynamo.reset()
    backend = Backend(config, lowering=lowering, passes=passes)
    compiled = torch.compile(model, backend=backend)
    saved, loss = saved_activation_bytes(lambda: compiled(**batch).loss, [*model.parameters(), *batch.values()])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return backend, saved, loss.detach(), grads


def test_exact_saves_x_not_its_fp32_copy_and_keeps_the_gradients_bit_for_bit():
    model, batch = _bf16_model(torch.float32)
    without = PassManager([p for p in default_passes() if p.name != "recompute_adapter_cast"])
    # eager lowering: inductor rounds a bf16 value it fuses away differently from one it stores, and the pass
    # changes which are stored
    _, copies_saved, reference_loss, reference = _compiled(model, batch, Config(), "eager", without)
    backend, saved, loss, grads = _compiled(model, batch, Config())
    [record] = [r for r in backend.regions[0].passes if r.name == "recompute_adapter_cast"]
    # PEFT casts x per LoRA linear; merge_casts leaves one per x: q, k, v's, o's, gate and up's, down's, in 2 layers
    assert record.note.startswith("8 cast(s) of x to the adapters' dtype"), record
    tensors = [s for s in backend.regions[0].saved if s.frees_memory]
    assert not [s for s in tensors if s.role.value == "linear_input" and s.dtype == "float32"]
    assert saved < copies_saved
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_a_lossy_preset_plans_fp32_adapters_as_it_plans_adapters_in_the_models_dtype():
    """The saved tensors, their roles and their plans are those of the same model with bf16 adapters: x stored
    at 8 bits with the norm input rebuilt from it, X W replayed, o_proj's input recomputed with attention."""
    plans = {}
    for adapters in (torch.bfloat16, torch.float32):
        model, batch = _bf16_model(adapters)
        backend, *_ = _compiled(model, batch, Config.from_preset("hyclora-4bit"))
        region = backend.regions[0]
        plans[adapters] = sorted((s.role.value, s.layer, p.action, getattr(p, "bits", None))
                                 for s, p in zip(region.saved, region.plans, strict=True)
                                 if s.frees_memory and s.role.value != "lora_intermediate")
    assert plans[torch.float32] == plans[torch.bfloat16]
    assert ("norm_input", "base_model.model.model.layers.1", "prenorm", 8) in plans[torch.float32]
    # x of layer 1's linears at 8 bits (layer 0's first norm input, the embedding, is recomputed: no rebuild)
    assert {p[3] for p in plans[torch.float32] if p[0] == "linear_input" and p[1].endswith("layers.1")} == {8}


def test_a_model_without_casts_is_left_alone():
    model, batch = tiny_model("llama", lora=True)
    backend, *_ = _compiled(model, batch, Config())
    [record] = [r for r in backend.regions[0].passes if r.name == "recompute_adapter_cast"]
    assert record.note == "" and record.error is None


def test_the_chain_stops_at_one_widening_cast_and_narrowing_casts_are_left_alone():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxmem.passes.joint.adapter_cast import widening_cast

    def lora_input(h, a):  # a norm ending in a cast of its own (Gemma's type_as), then PEFT's cast to fp32
        x = (h * 2).to(torch.bfloat16)
        wide = x.to(torch.float32).view(-1, 8) @ a
        narrow = h.to(torch.bfloat16).view(-1, 8) @ a.to(torch.bfloat16)  # autocast's: to the smaller dtype
        return wide, narrow

    graph = make_fx(lora_input, tracing_mode="fake")(torch.randn(2, 4, 8), torch.randn(8, 3)).graph
    wide_mm, narrow_mm = [n for n in graph.nodes if n.target is torch.ops.aten.mm.default]
    chain = widening_cast(wide_mm.args[0])
    assert [n.target for n in chain][-1] in (torch.ops.prims.convert_element_type.default,
                                             torch.ops.aten._to_copy.default)
    x = chain[-1].args[0]
    assert x.meta["val"].dtype == torch.bfloat16  # the norm's own cast, not the fp32 product before it
    assert widening_cast(narrow_mm.args[0]) == []


def test_autocast_over_an_fp32_model_casts_down_and_the_pass_leaves_it():
    model, batch = tiny_model("llama", lora=True)
    torch._dynamo.reset()
    backend = Backend(Config.from_preset("hyclora-4bit"), lowering="eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    [record] = [r for r in backend.regions[0].passes if r.name == "recompute_adapter_cast"]
    assert record.note == "" and record.error is None
