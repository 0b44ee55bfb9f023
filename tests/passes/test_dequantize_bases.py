"""A bitsandbytes 4-bit base read by the chunked MLP and linears, on the tests' QLoRA model as users prepare it."""

import dataclasses
import functools

import pytest
import torch

import fxmem
from fxmem.measure import gradient_fidelity, model_tensors, saved_activation_bytes
from tests.conftest import loss_and_grads, pass_summary, randomize_lora_b, tiny_model
from tests.models import TINY_QLORA

_summary = functools.partial(pass_summary, name="dequantize_bases")


def _qlora(compute_dtype):
    model, batch = dataclasses.replace(TINY_QLORA, dtype=compute_dtype).build()
    randomize_lora_b(model)
    return model, batch


def _saved_and_grads(model, batch, config):
    torch._dynamo.reset()
    backend = fxmem.Backend(config, lowering="eager")
    forward = torch.compile(model, backend=backend)
    saved, _ = saved_activation_bytes(lambda: forward(**batch), model_tensors(model) + list(batch.values()))
    return backend, saved, loss_and_grads(forward, model, batch)


# float32: the casts around each product do nothing; bfloat16: QLoRA's usual bnb_4bit_compute_dtype, each product
# between two casts on float32 hidden states (prepare_model_for_kbit_training keeps them so)
@pytest.mark.parametrize("compute_dtype, min_cosine", [(torch.float32, 1 - 1e-9), (torch.bfloat16, 1 - 1e-5)])
def test_a_qlora_model_runs_its_mlps_and_projections_in_chunks_with_the_gradients_of_eager(compute_dtype, min_cosine):
    model, batch = _qlora(compute_dtype)
    reference_loss, reference = loss_and_grads(model, model, batch)
    _, whole, _ = _saved_and_grads(model, batch, fxmem.Config())
    backend, saved, (loss, grads) = _saved_and_grads(model, batch, fxmem.Config(mlp_chunk=8, linear_chunk=8))
    assert _summary(backend) == ("14 bitsandbytes 4-bit product(s) as a linear on the weight dequantized by "
                                 "bitsandbytes, recomputed in backward, for the chunked ops to read")
    assert pass_summary(backend, "chunk_mlp").startswith("2 SwiGLU MLP(s) of 64 tokens x 172 in chunks of 8")
    # q, k and v as one op, o alone, in each block
    assert pass_summary(backend, "chunk_linears").startswith("8 LoRA linear(s) in 4 op(s) of one input each "
                                                             "(3, 1, 3, 1 linears)")
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    assert gradient_fidelity(reference, grads).min_cosine >= min_cosine
    # no dequantized weight is saved (backward dequantizes again), and the MLPs' and projections' rows are gone:
    # measured 741,396 and 653,332 bytes whole, 331,796 chunked
    assert saved == backend.report().planned_bytes and saved < 0.51 * whole
    assert not [s for _, s, _ in backend.report().rows() if s.producer.startswith("dequantize")]


def test_without_a_4bit_base_the_pass_says_so():
    model, batch = tiny_model("llama", lora=True, layers=1)
    backend = fxmem.backend("exact", mlp_chunk=8)
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == "no bitsandbytes 4-bit product (gemm_4bit)"


@pytest.mark.parametrize("setting", ["dropout", "autocast"])
def test_a_product_the_chunked_ops_would_not_take_is_left_as_bitsandbytes_runs_it(setting):
    # dropout: PEFT's LoRA term reads dropout(x), which no chunked op reproduces; autocast: a linear would run in
    # autocast's dtype where gemm_4bit runs in its computation dtype
    model, batch = TINY_QLORA.build(lora_dropout=0.1 if setting == "dropout" else 0.0)
    backend = fxmem.backend("exact", mlp_chunk=8, linear_chunk=8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == ("no bitsandbytes 4-bit product (gemm_4bit); 14 left as bitsandbytes runs it (a bias, "
                                 "autocast, or no LoRA sum the chunked ops take: dropout)")
    assert pass_summary(backend, "chunk_mlp").startswith("no SwiGLU MLP")
