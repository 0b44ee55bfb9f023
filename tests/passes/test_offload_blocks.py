import functools

import pytest
import torch

import fxmem
from fxmem.analysis.graph import storage_bytes
from fxmem.cost_model import host_bytes, planned_bytes
from fxmem.passes.partitioned import offload_blocks
from fxmem.whatif import predicted_activation_bytes
from tests.conftest import loss_and_grads, pass_summary, randomize_lora_b, tiny_model

PRESETS = ["exact", "hyclora-4bit"]
moved = offload_blocks._offload


def _config(preset: str, **options) -> fxmem.Config:
    return fxmem.Config.from_preset(preset, block_checkpoint=True, mlp_chunk=8, **options)


_summary = functools.partial(pass_summary, name="offload_blocks")


def test_what_goes_to_host_memory_is_what_the_plans_store_and_the_gradients_do_not_change(monkeypatch):
    # Inductor lowers each device_put on a CPU as a copy: the step runs on the copies both ways
    sent = []
    monkeypatch.setattr(offload_blocks, "_offload", lambda editor, part, position: (
        sent.append(storage_bytes(part.meta["val"])), moved(editor, part, position)))
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    loss, grads = loss_and_grads(torch.compile(model, backend=fxmem.Backend(_config("hyclora-4bit"))), model, batch)
    assert not sent
    torch._dynamo.reset()
    backend = fxmem.Backend(_config("hyclora-4bit", block_offload=True))
    offloaded_loss, offloaded_grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    # the embedding and the first block's output as the 5 non-empty tensors of their 8-bit codes, the last block's
    # output (the loss's input) kept exact
    assert len(sent) == 2 * 5 + 1 and sum(sent) == backend.report().host_bytes > 0
    assert _summary(backend).startswith("11 stored tensor(s) of 3 block input(s) in host memory")
    assert torch.equal(offloaded_loss, loss)
    assert all(torch.equal(offloaded_grads[name], g) for name, g in grads.items())


@pytest.mark.parametrize("preset", PRESETS)
def test_the_plans_put_the_block_inputs_in_host_memory_priced_by_their_copies(preset):
    model, batch = tiny_model("llama", lora=True)
    plain = fxmem.inspect(model, **batch, config=_config(preset, return_logits=False), guard=False)
    report = fxmem.inspect(model, **batch, config=_config(preset, return_logits=False, block_offload=True), guard=False)
    hosted = [(s, p) for _, s, p in report.rows() if p.host]
    assert len(hosted) == 3 and all("in host memory between forward and backward" in p.reason for _, p in hosted)
    assert all(p.seconds > q.seconds for (_, p), (_, _, q) in zip(hosted, [r for r in plain.rows()
                                                                          if r[1].name in {s.name for s, _ in hosted}],
                                                                strict=True))
    assert report.host_bytes == sum(host_bytes(s, p) for s, p in hosted) > 0
    assert report.planned_bytes == plain.planned_bytes - report.host_bytes
    assert all(planned_bytes(s, p) == 0 for s, p in hosted)


def test_whatif_counts_host_memory_apart_and_the_copy_back_among_backwards_transients():
    model, batch = tiny_model("llama", lora=True)
    plain = predicted_activation_bytes(model, batch, _config("hyclora-4bit", return_logits=False))
    offloaded = predicted_activation_bytes(model, batch, _config("hyclora-4bit", return_logits=False,
                                                                 block_offload=True))
    assert plain.host == 0 < offloaded.host
    assert offloaded.saved == plain.saved - offloaded.host
    # backward holds a block's input copied back where it held the saved one: the transients (net of what backward
    # frees of the saved tensors) grow by at most what is copied back at once, one block's
    assert plain.transient < offloaded.transient <= plain.transient + offloaded.host


def test_block_offload_needs_block_checkpoint():
    with pytest.raises(ValueError, match="block_offload moves a checkpointed block's stored input to host memory: "
                                         "set block_checkpoint=True too"):
        fxmem.Config(block_offload=True)


def test_a_stored_input_the_pass_cannot_move_stays_on_the_device_and_its_plan_says_so(monkeypatch, lenient):
    monkeypatch.setattr(offload_blocks, "stashed_unchecked", lambda node: True)  # as if AOTAutograd held them
    model, batch = tiny_model("llama", lora=True)
    with pytest.warns(fxmem.FallbackWarning, match="planned offload to host memory left undone, kept on the device: "
                                                   "embedding, add_10, add_20"):
        report = fxmem.inspect(model, **batch, config=_config("exact", return_logits=False, block_offload=True))
    [region] = report.regions
    assert report.host_bytes == 0 and not any(p.host for p in region.plans)
    left = [p for p in region.plans if "left on the device: " in p.reason]
    assert len(left) == 3 and all(p.seconds == 0 for p in left)  # the copies' price gone with them
    assert _summary(report) == "left on the device: embedding, add_10, add_20 (their plans say why)"
    # the planner's plans are kept apart from what the pass applied
    undone = region.undone()
    assert sorted(s.name for s, _, _ in undone) == ["add_10", "add_20", "embedding"]
    assert all(planned.host and not applied.host for _, planned, applied in undone)
    [saved] = [s for s in report.to_dict()["regions"][0]["saved"] if s["name"] == "add_10"]
    assert saved["planned"]["host"] is True and "host" not in saved["plan"]


def test_strict_mode_refuses_an_offload_left_undone(monkeypatch):
    monkeypatch.setattr(offload_blocks, "stashed_unchecked", lambda node: True)
    model, batch = tiny_model("llama", lora=True, layers=1)
    # dynamo wraps the backend's error
    with pytest.raises(Exception, match="planned offload to host memory left undone, kept on the device: embedding, "
                                        "add_10 .strict mode"):
        fxmem.inspect(model, **batch, config=_config("exact", return_logits=False, block_offload=True, strict=True))


def test_a_stage_rolled_back_leaves_nothing_in_host_memory(monkeypatch, lenient):
    def failing(self, state):
        raise RuntimeError("a failing pass")

    monkeypatch.setattr(offload_blocks.OffloadBlocks, "run", failing)
    model, batch = tiny_model("llama", lora=True)
    with pytest.warns(fxmem.FallbackWarning, match="pass offload_blocks"):
        report = fxmem.inspect(model, **batch, config=_config("exact", return_logits=False, block_offload=True))
    assert report.host_bytes == 0 and not any(p.host for _, _, p in report.rows())
