"""What a region holds that no plan can free, in the report's notes: a KV cache, inputs the caller keeps, and
activation checkpointing's reruns (HF's gradient_checkpointing_enable trains correctly under fxmem)."""

import pytest
import torch

import fxmem
from fxmem.analysis.graph import storage_bytes
from fxmem.measure import format_bytes, gradient_fidelity
from tests.conftest import loss_and_grads, randomize_lora_b, tiny_model


def _training_notes(backend: fxmem.Backend) -> list[str]:
    return [note for region in backend.regions if region.kind == "training" for note in region.notes]


@pytest.mark.parametrize("preset, kv_heads", [("exact", 4), ("hyclora-4bit", 4), ("exact", 2)])
def test_a_returned_kv_cache_is_named_with_its_bytes_and_use_cache_false_frees_it(preset, kv_heads):
    # hyclora-4bit: k and v rebuilt in backward, not saved; 2 kv heads: GQA repeats them before attention
    model, batch = tiny_model("llama", lora=True, kv_heads=kv_heads)
    backend = fxmem.Backend(fxmem.Config.from_preset(preset), lowering="eager")
    output = torch.compile(model, backend=backend)(**batch, use_cache=True)
    cache = [t for layer in output.past_key_values.layers for t in (layer.keys, layer.values)]
    expected = sum(storage_bytes(t) for t in {t.untyped_storage().data_ptr(): t for t in cache}.values())
    [note] = [n for n in _training_notes(backend) if "KV cache" in n]
    assert note.startswith(f"the forward returns attention's k and v, {format_bytes(expected)} the caller holds")
    assert "use_cache=False in training frees it" in note
    torch._dynamo.reset()
    backend = fxmem.Backend(fxmem.Config.from_preset(preset), lowering="eager")
    torch.compile(model, backend=backend)(**batch, use_cache=False)
    assert not [n for n in _training_notes(backend) if "KV cache" in n]


def test_saved_inputs_the_caller_holds_are_counted():
    model, batch = tiny_model("llama", lora=True)
    # embeddings that train (prompt tuning): the first norm's backward then needs its input, the caller's tensor
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit"), lowering="eager")
    torch.compile(model, backend=backend)(inputs_embeds=embeds, labels=batch["labels"])
    assert any(n.startswith(f"{format_bytes(storage_bytes(embeds))} of saved tensors are inputs the caller holds")
               for n in _training_notes(backend))


@pytest.mark.parametrize("preset, min_cosine", [("exact", 1 - 1e-9), ("hyclora-4bit", 0.98)])
def test_hf_gradient_checkpointing_trains_under_fxmem_and_the_report_says_what_it_reruns(preset, min_cosine):
    model, batch = tiny_model("llama", lora=True, layers=2)
    randomize_lora_b(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference_loss, reference = loss_and_grads(model, model, batch)
    backend = fxmem.Backend(fxmem.Config.from_preset(preset), lowering="eager")
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)  # the forward is never compressed
    assert gradient_fidelity(reference, grads).min_cosine >= min_cosine
    [note] = [n for n in _training_notes(backend) if n.startswith("activation checkpointing")]
    assert "of 2 region(s) in backward" in note  # one per decoder layer
