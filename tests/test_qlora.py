"""QLoRA (PEFT LoRA on a bitsandbytes NF4 base, prepared as users prepare it) under fxmem, against eager QLoRA."""

import pytest
import torch

import fxmem
from fxmem.cost_model.plan import Action
from fxmem.measure import gradient_fidelity, model_tensors, saved_activation_bytes
from tests.conftest import loss_and_grads, randomize_lora_b
from tests.models import TINY_QLORA


def _setup():
    model, batch = TINY_QLORA.build()
    randomize_lora_b(model)  # past PEFT's zero B, so that every LoRA gradient is measured
    return model, batch


def test_the_qlora_workload_is_nf4_under_peft_lora():
    import bitsandbytes as bnb
    model, _ = _setup()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(layer.base_layer, bnb.nn.Linear4bit) and layer.base_layer.weight.quant_type == "nf4"
    assert not isinstance(model.base_model.model.lm_head, bnb.nn.Linear4bit)  # QLoRA keeps the head
    assert {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad} == {"default"}


@pytest.mark.parametrize("preset, min_cosine", [("exact", 1 - 1e-9), ("hyclora-4bit", 0.99)])
def test_fxmem_trains_qlora_as_eager_does(preset, min_cosine):
    model, batch = _setup()
    reference_loss, reference = loss_and_grads(model, model, batch)
    exclude = model_tensors(model) + list(batch.values())
    eager_saved, _ = saved_activation_bytes(lambda: model(**batch), exclude)
    backend = fxmem.Backend(fxmem.Config.from_preset(preset), lowering="eager")
    forward = torch.compile(model, backend=backend)
    saved, _ = saved_activation_bytes(lambda: forward(**batch), exclude)
    loss, grads = loss_and_grads(forward, model, batch)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    assert gradient_fidelity(reference, grads).min_cosine >= min_cosine
    assert saved == backend.report().planned_bytes
    if preset == "hyclora-4bit":
        assert saved * 3 < eager_saved
        # the NF4 base's X W replayed from x in backward (gate and up: they feed SiLU and the product), as a
        # full-precision base's is
        rebuilt = [s for _, s, p in backend.report().rows() if s.producer == "gemm_4bit" and p.action is Action.RECOMPUTE]
        assert len(rebuilt) == 4 and all(s.rebuilt_for in ("silu", "product") for s in rebuilt)
