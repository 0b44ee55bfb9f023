import functools

import pytest
import torch
import torch.nn.functional as F

import fxmem
from tests.conftest import loss_and_grads, pass_summary, randomize_lora_b, tiny_model

_summary = functools.partial(pass_summary, name="chunk_loss")


def _assert_same(reference, candidate, tolerance=1e-5):
    ref_loss, ref_grads = reference
    loss, grads = candidate
    assert torch.allclose(loss, ref_loss, rtol=1e-6, atol=0)
    assert ref_grads.keys() == grads.keys()
    for name, ref in ref_grads.items():
        # a floor: some gradients are zero but for rounding (a key's bias under softmax)
        assert float((grads[name] - ref).abs().max()) <= tolerance * max(float(ref.abs().max()), 1e-6), name


def _ignore_some(batch):
    labels = batch["labels"].clone()
    labels[0, :5] = -100
    return {**batch, "labels": labels}


@pytest.mark.parametrize("family, lora, chunks", [
    ("llama", True, "blocks of 32 rows x 256 classes, ignored tokens skipped"),  # a frozen head: online sums
    ("gpt2", False, "1 chunk(s) of 32 rows"),  # full fine-tuning of a head tied to the embedding
])
def test_a_causal_lm_loss_is_chunked_exactly_and_its_logits_returned_empty(family, lora, chunks):
    model, batch = tiny_model(family, lora=lora, layers=1)
    for module in model.modules():  # GPT-2's dropout: eager and compiled runs would draw different masks
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    batch = _ignore_some(batch)
    if lora:
        randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", return_logits=False)
    forward = torch.compile(model, backend=backend)
    assert forward(**batch).logits.shape == (0,)
    _assert_same(reference, loss_and_grads(forward, model, batch))
    assert f"32 tokens x 256 vocabulary in {chunks}; 0.0 MiB of float32 logits never whole" in _summary(backend)


def test_a_lora_on_the_head_trains_through_the_chunked_loss():
    from peft import LoraConfig, get_peft_model
    model, batch = tiny_model("llama", lora=False, layers=1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", return_logits=False)
    _assert_same(reference, loss_and_grads(torch.compile(model, backend=backend), model, batch))
    assert "in 1 chunk(s)" in _summary(backend)
    assert any("lm_head.lora_A" in name for name in reference[1])


def test_returned_logits_leave_the_loss_whole_and_say_how_to_chunk_it():
    model, batch = tiny_model("llama", lora=True, layers=1)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact")
    forward = torch.compile(model, backend=backend)
    assert forward(**batch).logits.shape == (2, 16, 256)
    _assert_same(reference, loss_and_grads(forward, model, batch))
    assert _summary(backend) == ("loss left as torch runs it: the logits are also a forward output (the model "
                                 "returns them); return_logits=False returns an empty tensor in their place and "
                                 "chunks the loss")


def test_num_items_in_batch_divides_the_chunked_sum():
    model, batch = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    batch = _ignore_some(batch)
    counted = (batch["labels"][:, 1:] != -100).sum()  # 27 of 30 shifted targets: 40 is not the mean's divisor
    mean = loss_and_grads(model, model, batch)
    batch = {**batch, "num_items_in_batch": torch.tensor(40)}
    reference = loss_and_grads(model, model, batch)
    torch.testing.assert_close(reference[0], mean[0] * counted / 40)  # HF's sum / num_items_in_batch
    exact = fxmem.backend("exact", return_logits=False)
    _assert_same(reference, loss_and_grads(torch.compile(model, backend=exact), model, batch))
    assert "in blocks of 32 rows x 256 classes" in _summary(exact)
    torch._dynamo.reset()
    # Compressed: the chunked loss is exact, so its gradients are those of the same preset with the loss whole
    backend = fxmem.backend("hyclora-4bit", return_logits=False)
    chunked = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    torch._dynamo.reset()
    whole = loss_and_grads(torch.compile(model, backend=fxmem.backend("hyclora-4bit")), model, batch)
    _assert_same(whole, chunked, tolerance=1e-4)
    plans = [(s.role.value, p.action) for r in backend.regions for s, p in zip(r.saved, r.plans)]
    assert ("loss_gradient", "keep") in plans  # the head input's gradient, computed in forward, stays exact


def test_a_masked_lm_heads_bias_leaves_its_loss_whole():
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                       num_attention_heads=4, vocab_size=256, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0))
    ids = torch.randint(0, 256, (2, 16))
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    batch = {"input_ids": ids, "labels": labels}
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", return_logits=False)
    _assert_same(reference, loss_and_grads(torch.compile(model, backend=backend), model, batch))
    assert "left as torch runs it: the head has a bias" in _summary(backend)


class _Head(torch.nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.loss = loss

    def forward(self, x, target):
        logits = self.head(x)
        if self.loss == "softcap":
            return F.cross_entropy(torch.tanh(logits / 30.0) * 30.0, target)
        if self.loss == "z-loss":
            return F.cross_entropy(logits, target) + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()
        if self.loss == "label-smoothing":
            return F.cross_entropy(logits, target, label_smoothing=0.1)
        if self.loss == "per-token":
            return F.cross_entropy(logits, target, reduction="none").sum()
        return F.cross_entropy(logits, target)


@pytest.mark.parametrize("loss, reason", [
    ("softcap", "the logits come from mul, not straight from a linear head"),
    ("z-loss", "the logits also feed logsumexp"),
    ("label-smoothing", "label smoothing"),
    ("per-token", "reduction 'none' (a loss per token)"),
])
def test_a_loss_of_another_form_is_left_as_torch_runs_it_with_the_reason(loss, reason):
    module = _Head(loss)
    x, target = torch.randn(32, 16, requires_grad=True), torch.randint(0, 64, (32,))
    expected = module(x, target)
    expected_grads = torch.autograd.grad(expected, (x, module.head.weight))
    backend = fxmem.backend("exact")
    got = torch.compile(module, backend=backend)(x, target)
    assert torch.allclose(got, expected, rtol=1e-6)
    for grad, expected_grad in zip(torch.autograd.grad(got, (x, module.head.weight)), expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert reason in _summary(backend)
    assert "chunk(s)" not in _summary(backend)


def test_without_gradients_the_loss_is_still_chunked_and_equal():
    module = _Head("plain")
    x, target = torch.randn(600, 16), torch.randint(0, 64, (600,))
    backend = fxmem.backend("exact")
    with torch.no_grad():
        expected = module(x, target)
        got = torch.compile(module, backend=backend)(x, target)
    assert torch.allclose(got, expected, rtol=1e-6)
    assert "600 tokens x 64 vocabulary in 3 chunk(s) of 256 rows" in _summary(backend)


def test_chunk_loss_off_leaves_the_loss_alone():
    module = _Head("plain")
    backend = fxmem.backend("exact", chunk_loss=False)
    torch.compile(module, backend=backend)(torch.randn(8, 16), torch.randint(0, 64, (8,)))
    assert "chunk_loss" not in [p.name for r in backend.regions for p in r.passes]


def test_a_dynamic_sequence_length_is_still_chunked_and_exact():
    model, _ = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    backend = fxmem.backend("exact", return_logits=False)
    forward = torch.compile(model, backend=backend)
    for seq in (16, 24, 32):  # the second length makes dynamo trace the length as a symbol
        ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seq))
        batch = {"input_ids": ids, "labels": ids}
        _assert_same(loss_and_grads(model, model, batch), loss_and_grads(forward, model, batch))
    assert len(backend.regions) == 2
    assert "in blocks of 48 rows x 256 classes" in _summary(backend)  # the dynamic region: from the traced length
