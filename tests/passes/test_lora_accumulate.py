import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxmem
from fxmem.measure import peak_memory
from fxmem.passes import LoraAccumulate, PipelineState
from tests.conftest import assert_matches_eager, loss_and_grads, randomize_lora_b, tiny_model


def _summary(backend) -> str:
    return "; ".join(p.summary for r in backend.regions for p in r.passes if p.name == "lora_accumulate")


# 2 layers x 7 linears in forward, and 7 sums of x's gradient in backward (dY W + s (dY B) A). With dynamic shapes
# dynamo traces PEFT's scaling as a tensor, and forward's sums stay adds: addmm's alpha is a number.
@pytest.mark.parametrize("dynamic, accumulated", [(False, 21), (True, 7)])
def test_each_lora_sum_is_one_addmm_with_the_gradients_of_eager(dynamic, accumulated):
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact")
    loss, grads = loss_and_grads(torch.compile(model, backend=backend, dynamic=dynamic), model, batch)
    assert _summary(backend) == f"{accumulated} LoRA sum(s) accumulated into the frozen output"
    assert_matches_eager(reference, loss, grads)


def test_a_sum_of_a_bf16_product_and_fp32_adapters_is_left_as_peft_adds_it():
    # PEFT's fp32 adapters on a bf16 model: the sum adds a float32 product to a bf16 one, in float32
    model, batch = tiny_model("llama", lora=True, dtype=torch.bfloat16)
    backend = fxmem.Backend(fxmem.Config(), lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert _summary(backend) == ""
    assert all(p.error is None for r in backend.regions for p in r.passes)  # left, not failed


def test_a_sum_whose_lora_side_is_sliced_is_left_as_it_adds():
    # a LoRA-shaped sum whose LoRA side is one row broadcast over the frozen product: an addmm would add every row
    def f(x, w, a, b):
        frozen = x @ w.t()
        lora = ((x @ a.t()) @ b.t()) * 2.0
        return frozen + lora[:1]

    x, w, a, b = torch.randn(8, 16), torch.randn(16, 16), torch.randn(4, 16), torch.randn(16, 4)
    gm = make_fx(f)(x, w, a, b)
    state = PipelineState(config=fxmem.Config(), fw=gm, bw=make_fx(lambda: None)())
    assert LoraAccumulate().run(state) == ""
    torch.testing.assert_close(gm(x, w, a, b), f(x, w, a, b))


def test_an_unchunked_long_step_holds_less(monkeypatch):
    # inductor computes an add inside the kernel that reads it: without the pass the gate's and up's frozen and
    # LoRA products all stay whole until the SwiGLU backward's kernel (llama-small, 2,048 tokens: 356.1 -> 291.6
    # MiB, docs/long-context.md)
    model, _ = tiny_model("llama", lora=True)
    ids = torch.randint(0, 256, (1, 1024), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def step_peak():
        torch._dynamo.reset()
        forward = torch.compile(model, backend=fxmem.backend("hyclora-4bit", return_logits=False))
        forward(**batch).loss.backward()  # compiled, with its gradients' storage
        return peak_memory(lambda: forward(**batch).loss.backward(), "cpu")

    with_pass = step_peak()
    monkeypatch.setattr(LoraAccumulate, "run", lambda self, state: "")
    assert with_pass < step_peak()
