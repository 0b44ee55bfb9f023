import torch

import fxmem
from fxmem.analysis import Role
from fxmem.measure import gradient_fidelity
from tests.conftest import loss_and_grads, randomize_lora_b, tiny_model


def _compiled(model, batch, backend):
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch, seed=3)
    torch._dynamo.reset()
    return loss, grads


def test_exact_with_lora_dropout_computes_torch_compiles_gradients_with_no_mask_saved():
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1, layers=1)
    randomize_lora_b(model)
    reference_loss, reference = _compiled(model, batch, "inductor")  # the same seed draws the same masks
    backend = fxmem.backend("exact")
    loss, grads = _compiled(model, batch, backend)
    assert loss == reference_loss
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    summary = {p.name: p.note for p in backend.regions[0].passes}["replay_dropout"]
    assert summary.startswith("7 LoRA input dropout(s) replayed in backward from their seeds")  # q k v o gate up down
    assert not [s for _, s, _ in backend.report().rows() if s.role is Role.DROPOUT_MASK]


def test_hyclora_with_lora_dropout_plans_the_bytes_it_plans_without():
    plans = {}
    for dropout in (0.0, 0.1):
        model, batch = tiny_model("llama", lora=True, lora_dropout=dropout, layers=1)
        randomize_lora_b(model)
        _, reference = _compiled(model, batch, "inductor")
        backend = fxmem.backend("hyclora-4bit")
        _, grads = _compiled(model, batch, backend)
        plans[dropout] = (backend.report().planned_bytes, gradient_fidelity(reference, grads).min_cosine)
    (plain, plain_cosine), (dropped, dropped_cosine) = plans[0.0], plans[0.1]
    assert plain <= dropped <= plain + 256  # the step's seeds: a few int64s
    assert dropped_cosine > 0.99 and abs(dropped_cosine - plain_cosine) < 0.003


def test_a_dropout_drawn_from_a_stateful_generator_is_not_replayed():
    # fallback_random: dropout stays aten's native_dropout, whose generator a replay would advance
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1, layers=1)
    randomize_lora_b(model)
    with torch._inductor.config.patch(fallback_random=True):
        _, reference = _compiled(model, batch, "inductor")
        backend = fxmem.backend("exact")
        _, grads = _compiled(model, batch, backend)
    assert {p.name: p.note for p in backend.regions[0].passes}["replay_dropout"] == ""
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_run_eagerly_a_replayed_mask_is_the_mask_forward_drew():
    # inductor_random's eager form ignores its seed: run_eagerly draws from it, as inductor's code does
    from fxmem.passes import PassManager
    from fxmem.techniques import default_passes
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1, layers=1)
    randomize_lora_b(model)
    saved_masks = PassManager([p for p in default_passes() if p.name != "replay_dropout"])
    _, reference = _compiled(model, batch, fxmem.Backend(fxmem.Config(), lowering="eager", passes=saved_masks))
    backend = fxmem.Backend(fxmem.Config(), lowering="eager")
    _, grads = _compiled(model, batch, backend)
    assert {p.name: p.note for p in backend.regions[0].passes}["replay_dropout"].startswith("7 LoRA input")
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
