import pytest

from fxmem.cost_model.loss import (
    BLOCK_ROWS,
    MIN_CHUNK_ROWS,
    VOCAB_CHUNK,
    LossChunks,
    chunked_loss_bytes,
    logits_bytes,
    loss_chunk_rows,
    loss_chunks,
    unfused_loss_bytes,
)


@pytest.mark.parametrize("tokens, vocab, hidden, element_size, rows", [
    (2048, 32000, 1024, 4, MIN_CHUNK_ROWS),  # llama-small: 65 rows as large as the input, raised to the floor
    (100, 32000, 1024, 4, 100),  # fewer tokens than the floor: one chunk
    (65536, 32000, 4096, 2, 4194),  # a chunk's float32 logits as large as the bf16 head input
    (4096, 128256, 4096, 2, MIN_CHUNK_ROWS),
])
def test_a_chunk_is_as_large_as_the_head_input_within_the_floor_and_the_tokens(tokens, vocab, hidden,
                                                                               element_size, rows):
    assert loss_chunk_rows(tokens, vocab, hidden, element_size) == rows


@pytest.mark.parametrize("element_size, head_trains, device_type, chunks", [
    (4, False, "cpu", LossChunks(BLOCK_ROWS, VOCAB_CHUNK)),  # a frozen head: online sums over vocabulary chunks
    (2, False, "cpu", LossChunks(BLOCK_ROWS, VOCAB_CHUNK)),
    (4, False, "cuda", LossChunks(BLOCK_ROWS, VOCAB_CHUNK)),
    (2, False, "cuda", LossChunks(MIN_CHUNK_ROWS, None)),  # bf16 on a GPU: a float32 second product not measured
    (4, True, "cpu", LossChunks(MIN_CHUNK_ROWS, None)),  # a training head needs whole rows
])
def test_a_frozen_head_is_cut_in_vocabulary_chunks_and_a_training_one_in_rows(element_size, head_trains,
                                                                               device_type, chunks):
    assert loss_chunks(4096, 128256, 4096, element_size, head_trains=head_trains, device_type=device_type) == chunks


def test_small_losses_take_one_block():
    assert loss_chunks(100, 500, 64, 4, head_trains=False, device_type="cpu") == LossChunks(100, 500)


def test_the_chunked_loss_holds_a_chunk_and_the_input_gradient_where_the_unfused_holds_three_logits():
    tokens, vocab, hidden = 4096, 128256, 4096
    gradient = tokens * hidden * 2
    assert unfused_loss_bytes(tokens, vocab, 2) == tokens * vocab * (2 + 4 + 4)
    rows = LossChunks(256, None)
    assert chunked_loss_bytes(tokens, vocab, hidden, 2, rows) == 256 * vocab * (4 + 2) + gradient
    assert chunked_loss_bytes(tokens, vocab, hidden, 2, rows) < logits_bytes(tokens, vocab) / 8
    # blocks: logits (float32, and bf16 before the upcast), the block's input and target rows, its float32 input
    # and weighted sum, and the vocabulary chunk in float32
    blocks = LossChunks(256, 1024)
    assert chunked_loss_bytes(tokens, vocab, hidden, 2, blocks) == (
        256 * 1024 * (4 + 2) + 256 * hidden * (2 + 2 + 4 + 4) + 1024 * hidden * 4 + gradient)
    assert chunked_loss_bytes(tokens, vocab, hidden, 2, blocks) < gradient * 2
