import pytest

from fxmem_bench.finetune import finetune
from tests.bench.conftest import TINY_LLAMA


def test_finetune_rejects_unknown_methods_and_too_few_steps():
    with pytest.raises(ValueError, match="unknown method 'deepspeed'; valid methods: eager, compile, hf-checkpointing, fxmem"):
        finetune(TINY_LLAMA, ("eager", "deepspeed"), steps=3)
    with pytest.raises(ValueError, match="steps must be >= 3"):
        finetune(TINY_LLAMA, steps=2)
