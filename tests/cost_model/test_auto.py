import importlib
import re

import pytest
import torch

import fxmem
from fxmem.cost_model.auto import MAX_AUTO_ROWS, MIN_AUTO_ROWS, choose_auto, chunk_rows, lowers_peak
from fxmem.kernels import chunked_mlp
from fxmem.measure import peak_memory
from tests.conftest import assert_matches_eager, loss_and_grads, pass_summary, randomize_lora_b, tiny_model

AUTO = {"mlp_chunk": "auto", "norm_chunk": "auto", "linear_chunk": "auto"}


def _mlp_rows(tokens: int, hidden: int, width: int, element_size: int) -> int:
    return chunk_rows("auto", tokens, hidden * element_size,
                      lambda backward: chunked_mlp.workspace_bytes(1, 1, width, element_size, backward=backward))


def test_auto_chunks_hold_no_more_than_their_input_within_the_row_bounds():
    # llama-small's MLP (1024 -> 2752, fp32) at 11,392 tokens: 11,392 * 4 KiB / (2752 * 32 B), 529.9 rows
    assert _mlp_rows(11_392, 1024, 2752, 4) == 529
    # Llama-3-8B's (4096 -> 14336, bf16) at 409,600 tokens would take 10,638 rows: capped
    assert _mlp_rows(409_600, 4096, 14336, 2) == MAX_AUTO_ROWS == 2048
    # a short sequence: the floor, and never more than its tokens
    assert _mlp_rows(1024, 64, 172, 4) == MIN_AUTO_ROWS == 128
    assert _mlp_rows(16, 64, 172, 4) == 16
    assert chunk_rows(512, 11_392, 4096, lambda backward: 88_064) == 512  # a number is taken as it is


def test_an_auto_option_is_on_from_a_tenth_off_the_predicted_peak():
    assert lowers_peak(1000, 900)
    assert not lowers_peak(1000, 901)
    assert not lowers_peak(0, 0)


def test_every_set_of_auto_groups_is_weighed_so_blocks_may_pay_only_with_chunks():
    # whatif's Llama-3-8B at 147,456 tokens (GiB): checkpointed blocks alone hold their MLPs whole in backward
    peaks = {(None, False): 470, ("auto", False): 72, (None, True): 517, ("auto", True): 40}
    config = fxmem.Config(mlp_chunk="auto", block_checkpoint="auto")
    choice = choose_auto(config, lambda c: peaks[c.mlp_chunk, c.block_checkpoint] * 2**30)
    assert (choice.config.mlp_chunk, choice.config.block_checkpoint, choice.failure) == ("auto", True, None)
    assert choice.notes == [
        ("mlp_chunk=auto: chunked, the step's activations predicted to peak at 40.00 GiB chunked and 517.00 GiB not "
         "(chunked where 10% lower)"),
        ("block_checkpoint=auto: checkpointed, the step's activations predicted to peak at 40.00 GiB checkpointed "
         "and 72.00 GiB not (checkpointed where 10% lower)")]
    # a set with more on must beat the one chosen so far by a tenth
    peaks[("auto", True)] = 65
    choice = choose_auto(config, lambda c: peaks[c.mlp_chunk, c.block_checkpoint] * 2**30)
    assert choice.config.block_checkpoint is False


def _step_peak(model, batch, config):
    torch._dynamo.reset()
    backend = fxmem.Backend(config, lowering="eager")
    forward = torch.compile(model, backend=backend)
    forward(**batch).loss.backward()  # compiled and warm
    return backend, peak_memory(lambda: forward(**batch).loss.backward(), "cpu")


def test_auto_chunks_a_long_step_where_its_predicted_peak_drops_and_its_measured_peak_drops_too():
    model, _ = tiny_model("llama", lora=True, layers=1)
    ids = torch.randint(0, 256, (1, 1024), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    auto, auto_peak = _step_peak(model, batch, fxmem.Config(**AUTO))
    _, whole_peak = _step_peak(model, batch, fxmem.Config())
    note = auto.regions[0].notes[0]
    assert re.fullmatch(r"mlp_chunk=auto, norm_chunk=auto, linear_chunk=auto: chunked, the step's activations "
                        r"predicted to peak at [\d.]+ MiB chunked and [\d.]+ MiB not \(chunked where 10% lower\)", note)
    assert pass_summary(auto, "chunk_mlp").startswith("1 SwiGLU MLP(s) of 1024 tokens x 172 in chunks of 128 tokens")
    assert pass_summary(auto, "chunk_norm").startswith("3 RMSNorm(s) of 1024 tokens x 64 in chunks of 512 tokens")
    # q, k and v's op holds more a token than o's
    assert "1024 tokens in chunks of 248/256:" in pass_summary(auto, "chunk_linears")
    # measured: 6.81 MiB against 9.30 whole (the weights and their gradients in both), where the note predicted
    # 4.21 MiB of activations against 7.54
    assert auto_peak < whole_peak - 2 * 2**20


def test_auto_leaves_a_short_step_whole_and_says_why():
    model, batch = tiny_model("llama", lora=True, layers=1)  # 2 x 16 tokens: one chunk would hold them all
    backend = fxmem.backend("exact", mlp_chunk="auto")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    region = backend.regions[0]
    assert region.config.mlp_chunk is None
    assert pass_summary(backend, "chunk_mlp") == ""
    assert re.fullmatch(r"mlp_chunk=auto: not chunked, the step's activations predicted to peak at 0\.\d\d MiB chunked "
                        r"and 0\.\d\d MiB not \(chunked where 10% lower\)", region.notes[0])


def test_a_failed_prediction_leaves_the_ops_whole_and_reports_it(monkeypatch):
    def fail(gm):
        raise RuntimeError("no copy")

    # the prediction copies the dynamo graph; under exact without a budget nothing else does
    monkeypatch.setattr(importlib.import_module("fxmem.backend"), "copy_graph_module", fail)
    model, batch = tiny_model("llama", lora=True, layers=1)
    with pytest.raises(RuntimeError, match="mlp_chunk=auto: not chunked, the step could not be predicted "
                                           r"\(RuntimeError: no copy\)"):
        torch.compile(model, backend=fxmem.backend("exact", mlp_chunk="auto", strict=True))(**batch)
    torch._dynamo.reset()
    backend = fxmem.backend("exact", mlp_chunk="auto")
    monkeypatch.delenv("FXMEM_STRICT", raising=False)
    with pytest.warns(UserWarning, match="could not be predicted"):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    assert backend.regions[0].notes[0] == ("mlp_chunk=auto: not chunked, the step could not be predicted "
                                           "(RuntimeError: no copy)")


@pytest.mark.parametrize("preset, chosen", [("exact", True), ("hyclora-4bit", False)])
def test_auto_checkpoints_blocks_where_the_predicted_peak_drops_as_the_measured_one_does(preset, chosen):
    # measured, 2 layers at 512 tokens: exact 3.86 MiB checkpointed against 5.88 without; hyclora-4bit 3.68 against
    # 3.29, its saved tensors already small and the recomputed block's activations held whole in backward
    model, _ = tiny_model("llama", lora=True, layers=2)
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    config = fxmem.Config.from_preset(preset, return_logits=False)
    auto, auto_peak = _step_peak(model, batch, config.replace(block_checkpoint="auto"))
    _, checkpointed_peak = _step_peak(model, batch, config.replace(block_checkpoint=True))
    _, without_peak = _step_peak(model, batch, config)
    region = auto.regions[0]
    verdict = "checkpointed" if chosen else "not checkpointed"
    assert re.fullmatch(rf"block_checkpoint=auto: {verdict}, the step's activations predicted to peak at [\d.]+ MiB "
                        r"checkpointed and [\d.]+ MiB not \(checkpointed where 10% lower\)", region.notes[0])
    assert region.config.block_checkpoint is chosen
    assert auto_peak == (checkpointed_peak if chosen else without_peak)
    assert (checkpointed_peak < 0.8 * without_peak) if chosen else (without_peak < checkpointed_peak)


def test_auto_blocks_and_chunks_together_keep_the_gradients_of_eager():
    model, _ = tiny_model("llama", lora=True, layers=2)
    randomize_lora_b(model)
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    reference = loss_and_grads(model, model, batch)
    backend = fxmem.backend("exact", block_checkpoint="auto", mlp_chunk="auto")
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    chunks, blocks = backend.regions[0].notes[:2]
    assert blocks.startswith("block_checkpoint=auto: checkpointed,") and chunks.startswith("mlp_chunk=auto: chunked,")
    assert_matches_eager(reference, loss, grads)


def test_the_predictions_leave_no_calibration_state_behind():
    from fxmem.kernels import calibration
    model, batch = tiny_model("llama", lora=True, layers=1)
    before = set(calibration.SLOTS)
    backend = fxmem.backend("hyclora-4bit", calibration="static", mlp_chunk="auto")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    [region] = backend.regions
    assert region.slots and set(calibration.SLOTS) - before == {slot.id for slot in region.slots}


def test_a_region_left_unplanned_is_no_peak_of_zero_bytes(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("no plan")

    # every plan fails: each prediction's region compiles unplanned, and so does the region itself
    monkeypatch.setattr(importlib.import_module("fxmem.pipeline"), "plan_region", fail)
    monkeypatch.delenv("FXMEM_STRICT", raising=False)
    model, batch = tiny_model("llama", lora=True, layers=1)
    backend = fxmem.backend("exact", mlp_chunk="auto")
    with pytest.warns(UserWarning, match="could not be predicted"):
        torch.compile(model, backend=backend)(**batch).loss.backward()
    assert backend.regions[0].notes[0] == (
        "mlp_chunk=auto: not chunked, the step could not be predicted (saved-tensor analysis or planning failed "
        "(RuntimeError: no plan); this region compiles as plain inductor)")
    assert backend.regions[0].config.mlp_chunk is None
