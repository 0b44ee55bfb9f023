"""How many tokens of logits the chunked loss computes at a time, and what its logits would have cost.

A chunk's logits take as many bytes as the head's input (Liger-Kernel's rule too): the loss then adds at most
what the step already holds at the head, whatever the vocabulary. Below ``MIN_CHUNK_ROWS`` rows the head's
matmul gets too thin to run at full speed (a GPU's tiles are 128 rows; a CPU's blocked GEMM about as many), so
a chunk never has fewer, and it never has more rows than the tokens.
"""

from __future__ import annotations

MIN_CHUNK_ROWS = 256
LOGITS_ELEMENT_SIZE = 4  # the loss's logits are float32 (HF upcasts them); the chunk's bytes are priced so


def loss_chunk_rows(tokens: int, vocab: int, hidden: int, element_size: int) -> int:
    """Rows per chunk for ``tokens`` x ``vocab`` logits from a head input of ``hidden`` channels."""
    rows_as_large_as_input = hidden * element_size * tokens // (vocab * LOGITS_ELEMENT_SIZE)
    return max(1, min(tokens, max(MIN_CHUNK_ROWS, rows_as_large_as_input)))


def logits_bytes(tokens: int, vocab: int) -> int:
    """The whole float32 logits of ``tokens`` tokens."""
    return tokens * vocab * LOGITS_ELEMENT_SIZE


def unfused_loss_bytes(tokens: int, vocab: int, element_size: int) -> int:
    """What a model's unfused loss holds at its peak, early in backward, when the model returns its logits (every
    HF ``...ForCausalLM``): the logits in the model's dtype, the float32 log-probabilities saved for backward and
    the float32 gradient of the logits. Checked on llama-small, fp32, ``exact``: the step peak fell by 655 MiB
    with the loss chunked (docs/benchmarks.md), 694 MiB with the chunked loss's own 39 MiB, against 750 MiB here.
    """
    return tokens * vocab * (element_size + 2 * LOGITS_ELEMENT_SIZE)


def chunked_loss_bytes(tokens: int, vocab: int, hidden: int, element_size: int) -> int:
    """What the chunked loss holds at its peak: one chunk of float32 logits (beside it, while it is cast, the
    product in a narrower model dtype) and the head input's gradient."""
    rows = loss_chunk_rows(tokens, vocab, hidden, element_size)
    narrower = element_size if element_size < LOGITS_ELEMENT_SIZE else 0
    return rows * vocab * (LOGITS_ELEMENT_SIZE + narrower) + tokens * hidden * element_size
