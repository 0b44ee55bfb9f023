import torch

import fxmem
from fxmem.analysis import Role
from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.passes import PassManager
from fxmem.techniques import default_passes
from tests.conftest import loss_and_grads, randomize_lora_b, tiny_model


def _without_the_pass() -> Backend:
    return Backend(Config(), passes=PassManager([p for p in default_passes() if p.name != "recompute_inputs"]))


def _step(model, batch, backend, autocast: bool):
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return loss_and_grads(torch.compile(model, backend=backend), model, batch)


def packed(rows: torch.Tensor, lengths: tuple[int, ...] = (6, 4, 6)) -> dict[str, torch.Tensor]:
    """``rows`` ([batch, seq] token ids, seq the sum of ``lengths``) as documents of ``lengths`` flattened into one
    row, as a packing collator hands them over: ``position_ids`` restarting at each document, whose first label is
    -100."""
    labels = rows.clone()
    starts = torch.tensor((0, *lengths[:-1])).cumsum(0)
    labels[:, starts] = -100
    positions = torch.cat([torch.arange(length) for length in lengths]).repeat(rows.shape[0])
    return {"input_ids": rows.reshape(1, -1), "labels": labels.reshape(1, -1), "position_ids": positions.unsqueeze(0)}


def _weight_copies(backend: Backend) -> int:
    return sum(s.nbytes for _, s, _ in backend.report().rows() if s.producer == "_to_copy" and s.role is Role.UNKNOWN)


def test_autocasts_weight_copies_are_recomputed_and_the_gradients_stay_torch_compiles():
    model, batch = tiny_model("llama", lora=True, layers=1)  # fp32, run under autocast as Trainer(bf16=True) runs it
    randomize_lora_b(model)
    reference_loss, reference = _step(model, batch, "inductor", autocast=True)
    unchanged = _without_the_pass()
    _step(model, batch, unchanged, autocast=True)
    assert _weight_copies(unchanged) > 0  # without the pass, autograd saves the bf16 copies
    backend = fxmem.backend("exact")
    loss, grads = _step(model, batch, backend, autocast=True)
    assert _weight_copies(backend) == 0
    assert backend.report().activation_bytes < unchanged.report().activation_bytes
    summary = {p.name: p.note for p in backend.regions[0].passes}["recompute_inputs"]
    assert "cast(s) of the inputs" in summary and "recomputed in backward" in summary
    assert loss == reference_loss
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_a_packed_batchs_attention_mask_is_rebuilt_from_its_position_ids():
    model, batch = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    rows = packed(batch["input_ids"])
    assert rows["position_ids"].shape == (1, 32) and (rows["position_ids"] == 0).sum() > 2  # several documents
    _, reference = _step(model, rows, "inductor", autocast=False)
    unchanged, exact = _without_the_pass(), fxmem.backend("exact")
    _step(model, rows, unchanged, autocast=False)
    _, grads = _step(model, rows, exact, autocast=False)
    masks = {name: [s for _, s, _ in backend.report().rows() if s.role is Role.ATTN_MASK]
             for name, backend in (("without", unchanged), ("with", exact))}
    assert [tuple(s.shape) for s in masks["without"]] == [(1, 1, 32, 32)]
    assert masks["with"] == []
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
