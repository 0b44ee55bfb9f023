import functools

import pytest
import torch

import fxmem
from fxmem.passes import GraphPass, PassManager, PassResult
from fxmem.techniques import default_passes
from tests.conftest import assert_matches_eager, loss_and_grads, pass_summary, randomize_lora_b, tiny_model

_summary = functools.partial(pass_summary, name="causal_mask")


class _SquareTensors(GraphPass):
    """Records the partitioned graphs' tensors as wide as tokens x tokens."""

    name = "square_tensors"
    stage = "partitioned"

    def __init__(self, seq):
        self.seq, self.found = seq, []

    def run(self, state):
        self.found += [node.name for gm in (state.fw, state.bw) for node in gm.graph.nodes
                       if isinstance(value := node.meta.get("val"), torch.Tensor) and value.dim() >= 2
                       and tuple(value.shape[-2:]) == (self.seq, self.seq)]
        return PassResult(False)


def test_hf_llamas_mask_runs_as_is_causal_with_the_gradients_of_eager():
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact")
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert "mask attention_mask 2 x 1 x 16 x 16 proven causal: 2 attention call(s) run with is_causal=True" \
        in _summary(backend)
    assert_matches_eager(reference, loss, grads)


@pytest.mark.parametrize("with_pass", [True, False])
def test_the_mask_is_built_in_neither_pass_of_the_step(with_pass):
    model, _ = tiny_model("llama", lora=True)
    ids = torch.randint(0, 256, (2, 24))  # a length no other axis has (the heads' width is 16)
    batch = {"input_ids": ids, "labels": ids}
    square = _SquareTensors(24)
    passes = [p for p in default_passes() if with_pass or p.name != "causal_mask"] + [square]
    backend = fxmem.Backend(fxmem.Config.from_preset("hyclora-4bit"), lowering="eager", passes=PassManager(passes))
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert bool(square.found) != with_pass, square.found  # without the pass, torch builds the mask


def test_a_padding_mask_from_the_batch_is_left_as_torch_builds_it():
    model, batch = tiny_model("llama", lora=True)
    batch = {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}
    backend = fxmem.backend("exact")
    loss_and_grads(torch.compile(model, backend=backend), model, batch)
    summary = _summary(backend)
    assert "left as torch builds it: it reads the input 'L_kwargs_attention_mask_'" in summary, summary
