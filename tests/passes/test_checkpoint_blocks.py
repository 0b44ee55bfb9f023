import pytest
import torch

import fxmem
from fxmem.analysis.roles import FREES_NOTHING, Role
from fxmem.config import PUBLISHED_MIN_COSINE
from fxmem.cost_model.plan import Action
from tests.conftest import assert_matches_eager, loss_and_grads, randomize_lora_b, tiny_model, worst_cosine


def _summary(backend) -> str:
    return "; ".join(p.note for r in backend.regions for p in r.passes if p.name == "checkpoint_blocks")



def test_each_block_is_recomputed_from_its_output_with_the_gradients_of_eager():
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", block_checkpoint=True)
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert _summary(backend) == "2 block(s) checkpointed from their outputs, 2 tensor(s) saved between blocks"
    assert_matches_eager(reference, loss, grads)


def test_only_the_residual_stream_between_blocks_is_saved():
    model, batch = tiny_model("llama", lora=True)
    [region] = fxmem.inspect(model, **batch, config=fxmem.Config(block_checkpoint=True, return_logits=False)).regions
    activations = [s for s in region.saved if s.nbytes and s.role not in FREES_NOTHING
                   and s.role not in (Role.INDEX, Role.SMALL)]
    # the embedding (the first block's input), each block's output, and the chunked loss's gradient for its input
    assert [(s.shape, s.role) for s in activations] == [((2, 16, 64), Role.NORM_INPUT)] * 3 + [
        ((32, 64), Role.LOSS_GRADIENT)]


@pytest.mark.parametrize("block_input_bits, stored_bits", [(None, 8), (4, 4)])
def test_under_hyclora_the_blocks_sources_are_stored_at_their_bits_with_the_presets_fidelity(block_input_bits,
                                                                                            stored_bits):
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    config = fxmem.Config.from_preset("hyclora-4bit", block_checkpoint=True, mlp_chunk=8,
                                      block_input_bits=block_input_bits)
    # the planner's plan: the guard would raise 4-bit block inputs to 8 (the preset's bound is not met at 4)
    [region] = fxmem.inspect(model, **batch, config=config, guard=False).regions
    reasons = [p.reason for s, p in zip(region.saved, region.plans, strict=True) if p.action is Action.QUANTIZE]
    assert len(reasons) == 2 and all(r.startswith(f"{stored_bits}-bit") and "; block " in r for r in reasons), reasons
    reference = loss_and_grads(model, model, batch)
    _, grads = loss_and_grads(torch.compile(model, backend=fxmem.Backend(config)), model, batch)
    # at 4 bits every activation of a block is rebuilt from a coarser input: below the preset's bound (0.9843 here)
    bound = PUBLISHED_MIN_COSINE["hyclora-4bit"] if stored_bits == 8 else 0.98
    assert worst_cosine(reference[1], grads) >= bound


# LoRA's dropout; BERT's eager attention drops its probabilities and each block its hidden states: inductor draws
# them all from the step's seeds, and a recomputed block draws the same
@pytest.mark.parametrize("family, options", [("llama", {"lora_dropout": 0.1}), ("bert", {"attn": "eager"})])
def test_a_block_with_dropout_drawn_from_the_steps_seeds_is_recomputed_with_the_same_masks(family, options):
    model, batch = tiny_model(family, lora=True, layers=1, **options)
    randomize_lora_b(model)
    reference_loss, reference = loss_and_grads(torch.compile(model, backend="inductor"), model, batch, seed=3)
    torch._dynamo.reset()
    backend = fxmem.backend("exact", block_checkpoint=True)
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch, seed=3)
    assert _summary(backend) == "1 block(s) checkpointed from their outputs, 1 tensor(s) saved between blocks"
    assert loss == reference_loss  # the same seeds draw the same masks, in forward and in the recomputation
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_block_that_draws_from_a_stateful_generator_is_left_as_it_is(lenient):
    # fallback_random: dropout stays aten's native_dropout, whose generator a recomputation would advance
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1)
    backend = fxmem.Backend(fxmem.Config(block_checkpoint=True), lowering="eager")
    with torch._inductor.config.patch(fallback_random=True):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == "2 block(s) left as they are: they draw random numbers (aten.native_dropout.default)"


def test_strict_mode_refuses_a_block_it_would_leave_as_it_is():
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1, layers=1)
    backend = fxmem.Backend(fxmem.Config(block_checkpoint=True, strict=True), lowering="eager")
    with torch._inductor.config.patch(fallback_random=True), pytest.raises(
            Exception, match=r"checkpoint_blocks: 1 block\(s\) left as they are: they draw random numbers"):
        torch.compile(model, backend=backend)(**batch).loss.backward()


def test_a_graph_that_draws_masks_a_checkpointed_block_draws_again_is_not_run_eagerly(monkeypatch):
    # were inductor to fail on the backward graph, run eagerly it would draw other masks than forward drew
    import importlib
    backend_module = importlib.import_module("fxmem.backend")
    lower = backend_module.compile_fx_inner

    def fail_on_backward(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            raise NotImplementedError("a lowering bug")
        return lower(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend_module, "compile_fx_inner", fail_on_backward)
    model, batch = tiny_model("bert", lora=True, attn="eager", layers=1)
    backend = fxmem.backend("exact", block_checkpoint=True)
    with pytest.raises(RuntimeError, match="draws the dropout masks backward draws again"):
        torch.compile(model, backend=backend)(**batch).loss.backward()
