import torch

import fxmem
from fxmem.measure import gradient_fidelity
from tests.conftest import loss_and_grads, randomize_lora_b, tiny_model


def _summaries(backend) -> dict[str, str]:
    return {p.name: p.note for p in backend.regions[0].passes}


def _autocast_step(model, batch, backend, enabled=True):
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
        return loss_and_grads(torch.compile(model, backend=backend), model, batch)


def test_under_autocast_hyclora_finds_and_rebuilds_the_lora_linears_it_does_in_fp32():
    # autocast casts x once for the frozen matmul and again for lora_A: two casts the LoRA matcher took for two xs
    model, batch = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    _, reference = _autocast_step(model, batch, "inductor")
    summaries, grads = {}, None
    for enabled in (False, True):
        backend = fxmem.backend("hyclora-4bit")
        _, grads = _autocast_step(model, batch, backend, enabled)
        summaries[enabled] = _summaries(backend)
    assert summaries[True]["merge_casts"].endswith("duplicate cast(s) merged")
    assert summaries[False]["merge_casts"] == ""  # fp32: nothing to merge
    assert summaries[True]["lora_reorder"] == summaries[False]["lora_reorder"]
    assert summaries[True]["lora_reorder"].startswith("5 LoRA output(s) rebuilt in backward from x W and x A")
    assert gradient_fidelity(reference, grads).min_cosine > 0.99  # the autocast run's, the loop's last
