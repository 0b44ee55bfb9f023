"""How the chunked loss cuts its logits, and what its logits would have cost.

Two ways (kernels/linear_cross_entropy.py):

- A head that trains (or has a LoRA) needs each row's whole log-sum-exp before its gradient: chunks of rows over
  the whole vocabulary. A chunk's logits take as many bytes as the head's input (Liger-Kernel's rule too), so the
  loss adds at most what the step already holds at the head; below ``MIN_CHUNK_ROWS`` rows the head's matmul gets
  too thin to run at full speed (a GPU's tiles are 128 rows; a CPU's blocked GEMM about as many), so a chunk never
  has fewer, and never more rows than the tokens.
- A frozen head (a LoRA fine-tune): blocks of ``BLOCK_ROWS`` tokens by ``VOCAB_CHUNK`` classes, the softmax
  accumulated online. Both products stay as thick as the whole-vocabulary ones (a 256 x hidden by hidden x 1024
  GEMM), and a block's logits, inputs and sums (about 4 MiB at hidden 1024) stay in a CPU's last-level cache.
  The op runs as fast as torch.compile's unfused loss on the CPU (measured: docs/loss.md); other block sizes were
  not measured in the op.
  In a narrower model dtype on CUDA the rows chunks stay: the online sums take the head's second product in
  float32 (summed over the vocabulary, its roundings would add up), which a GPU runs several times slower than
  in bf16, and no GPU here has measured the trade.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_CHUNK_ROWS = 256
BLOCK_ROWS = 256
VOCAB_CHUNK = 1024
LOGITS_ELEMENT_SIZE = 4  # the loss's logits are float32 (HF upcasts them); the chunk's bytes are priced so


@dataclass(frozen=True)
class LossChunks:
    rows: int
    vocab: int | None  # classes per chunk; None: the whole vocabulary, a chunk of rows at a time

    def describe(self, tokens: int, vocab: int) -> str:
        if self.vocab is None:
            return f"{-(-tokens // self.rows)} chunk(s) of {self.rows} rows"
        return f"blocks of {self.rows} rows x {self.vocab} classes, ignored tokens skipped"


def loss_chunk_rows(tokens: int, vocab: int, hidden: int, element_size: int) -> int:
    """Rows per whole-vocabulary chunk for ``tokens`` x ``vocab`` logits from a head input of ``hidden`` channels."""
    rows_as_large_as_input = hidden * element_size * tokens // (vocab * LOGITS_ELEMENT_SIZE)
    return max(1, min(tokens, max(MIN_CHUNK_ROWS, rows_as_large_as_input)))


def loss_chunks(tokens: int, vocab: int, hidden: int, element_size: int, *, head_trains: bool,
                device_type: str) -> LossChunks:
    """How the chunked loss cuts ``tokens`` x ``vocab`` logits (module docstring)."""
    if head_trains or (element_size < LOGITS_ELEMENT_SIZE and device_type == "cuda"):
        return LossChunks(loss_chunk_rows(tokens, vocab, hidden, element_size), None)
    return LossChunks(max(1, min(tokens, BLOCK_ROWS)), min(vocab, VOCAB_CHUNK))


def logits_bytes(tokens: int, vocab: int) -> int:
    """The whole float32 logits of ``tokens`` tokens."""
    return tokens * vocab * LOGITS_ELEMENT_SIZE


def unfused_loss_bytes(tokens: int, vocab: int, element_size: int) -> int:
    """What a model's unfused loss holds at its peak, early in backward, when the model returns its logits (every
    HF ``...ForCausalLM``): the logits in the model's dtype, the float32 log-probabilities saved for backward and
    the float32 gradient of the logits. An estimate, a little above the drop measured on a step with the loss
    chunked (measured: docs/history/benchmarks-2026-11-26.md).
    """
    return tokens * vocab * (element_size + 2 * LOGITS_ELEMENT_SIZE)


def chunked_loss_bytes(tokens: int, vocab: int, hidden: int, element_size: int, chunks: LossChunks) -> int:
    """What the chunked loss holds at its peak: the head input's gradient and one chunk's working set. Rows chunks:
    the float32 logits (beside them, while cast, the product in a narrower dtype). Blocks: the float32 logits, the
    block's input and target rows and float32 weighted sum; in a narrower dtype also the product before its
    upcast, the vocabulary chunk and the block's input in float32."""
    narrower = element_size if element_size < LOGITS_ELEMENT_SIZE else 0
    gradient = tokens * hidden * element_size
    if chunks.vocab is None:
        return chunks.rows * vocab * (LOGITS_ELEMENT_SIZE + narrower) + gradient
    block = chunks.rows * chunks.vocab * LOGITS_ELEMENT_SIZE + chunks.rows * hidden * (2 * element_size
                                                                                       + LOGITS_ELEMENT_SIZE)
    if narrower:
        block += (chunks.rows * chunks.vocab * narrower + chunks.vocab * hidden * LOGITS_ELEMENT_SIZE
                  + chunks.rows * hidden * LOGITS_ELEMENT_SIZE)
    return block + gradient
