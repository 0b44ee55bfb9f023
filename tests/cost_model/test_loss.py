import pytest

from fxmem.cost_model.loss import MIN_CHUNK_ROWS, chunked_loss_bytes, logits_bytes, loss_chunk_rows, unfused_loss_bytes


@pytest.mark.parametrize("tokens, vocab, hidden, element_size, rows", [
    (2048, 32000, 1024, 4, MIN_CHUNK_ROWS),  # llama-small: 65 rows as large as the input, raised to the floor
    (100, 32000, 1024, 4, 100),  # fewer tokens than the floor: one chunk
    (65536, 32000, 4096, 2, 4194),  # a chunk's float32 logits as large as the bf16 head input
    (4096, 128256, 4096, 2, MIN_CHUNK_ROWS),
])
def test_a_chunk_is_as_large_as_the_head_input_within_the_floor_and_the_tokens(tokens, vocab, hidden,
                                                                               element_size, rows):
    assert loss_chunk_rows(tokens, vocab, hidden, element_size) == rows


def test_the_chunked_loss_holds_a_chunk_and_the_input_gradient_where_the_unfused_holds_three_logits():
    tokens, vocab, hidden = 4096, 128256, 4096
    assert unfused_loss_bytes(tokens, vocab, 2) == tokens * vocab * (2 + 4 + 4)
    assert chunked_loss_bytes(tokens, vocab, hidden, 2) == 256 * vocab * (4 + 2) + tokens * hidden * 2
    assert chunked_loss_bytes(tokens, vocab, hidden, 2) < logits_bytes(tokens, vocab) / 8
