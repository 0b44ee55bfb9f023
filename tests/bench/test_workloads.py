import math

import pytest
import torch

from fxmem_bench.choices import WORKLOAD_FAMILIES
from fxmem_bench.data import byte_token_batches, docstring_code_pairs, stdlib_bytes
from fxmem_bench.workloads import WORKLOADS, get_workload


def test_stdlib_text_is_real_and_deterministic():
    text = stdlib_bytes(1 << 16)
    assert len(text) == 1 << 16 and b"def " in text and b"import " in text
    assert stdlib_bytes(1 << 16) == text


def test_byte_token_batches_are_seeded_windows_of_bytes():
    first = next(byte_token_batches(4, 64, seed=3))
    assert first.shape == (4, 64) and first.dtype == torch.long and 0 <= first.min() and first.max() < 256
    assert torch.equal(first, next(byte_token_batches(4, 64, seed=3)))
    assert not torch.equal(first, next(byte_token_batches(4, 64, seed=4)))


def test_docstring_code_pairs_keep_the_docstring_out_of_the_code():
    pairs = docstring_code_pairs()
    assert len(pairs) >= 1000
    assert all(doc not in code for doc, code in pairs[:200])
    assert all(code.lstrip().startswith(("def ", "async def ", "@")) for _, code in pairs[:200])


def test_the_command_lists_every_workload_with_its_family():
    # `fxmem` lists and validates the workloads by WORKLOAD_FAMILIES, without importing torch to read WORKLOADS
    assert [(name, w.family) for name, w in WORKLOADS.items()] == list(WORKLOAD_FAMILIES.items())


def test_unknown_and_gpu_only_workloads_are_refused_clearly():
    with pytest.raises(ValueError, match="unknown workload 'llama-huge'; valid workloads: llama-tiny"):
        get_workload("llama-huge")
    with pytest.raises(ValueError, match="llama-7b-shape runs on a GPU only"):
        WORKLOADS["llama-7b-shape"].build(device="cpu")


def test_llama_tiny_has_lora_on_every_block_linear_only():
    setup = get_workload("llama-tiny").build()
    trainable = [n for n, p in setup.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 4 * 7 * 2 and all("lora_" in n for n in trainable)
    batch = next(setup.batches)
    assert batch["input_ids"].shape == (4, 256)
    assert math.isfinite(setup.loss(setup.model, batch).item())


def test_minilm_real_loads_pretrained_weights_that_beat_chance():
    setup = get_workload("minilm-real").build()
    trainable = [n for n, p in setup.model.named_parameters() if p.requires_grad]
    assert len(trainable) == 6 * 6 * 2  # q, k, v, attention output, intermediate, output per layer
    config = setup.model.base_model.model.config  # dropout 0, as docs/methodology.md: probes compare like with like
    assert config.hidden_dropout_prob == config.attention_probs_dropout_prob == 0.0
    batch = next(setup.batches)
    assert batch["input_ids"].shape == (32, 128)  # 16 docstrings then their 16 functions
    with torch.no_grad():
        loss = setup.loss(setup.model, batch).item()
    # Random embeddings would give about ln(16) = 2.77; the pretrained model matches most pairs.
    assert loss < 0.5 * math.log(16)
