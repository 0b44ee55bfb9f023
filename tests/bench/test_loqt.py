"""`fxmem bench loqt`: LoQT's pretraining settings on the same batches, and its commands' tables."""

import pytest

from fxmem import cli
from fxmem_bench.loqt import pretrain_settings, train
from tests.bench.conftest import TINY_LLAMA


def test_pretrain_bench_trains_every_setting_on_the_same_batches():
    settings = pretrain_settings(4, scale=0.5, first_interval=2)
    assert [s.name for s in settings] == ["full training", "LoQT-nq", "LoQT", "LoQT, no compensation",
                                          "LoQT, fixed interval"]
    full, nq, quantized = (train(TINY_LLAMA, s, steps=5, lr=1e-3, loqt_lr=1e-2, eval_batches=2, adapter_only=False)
                           for s in settings[:3])
    # The same initial weights and first batch: LoQT-nq computes the same function, LoQT up to NF4's error.
    assert nq.losses[0] == pytest.approx(full.losses[0], rel=1e-6)
    assert quantized.losses[0] == pytest.approx(full.losses[0], rel=1e-2)
    assert quantized.losses[0] != full.losses[0]
    assert nq.merge_steps == quantized.merge_steps == settings[2].config.merge_steps(5) == [2, 5]
    assert full.weight_bits == nq.weight_bits == 32 and 4.1 < quantized.weight_bits < 4.2
    assert quantized.trainable_params < full.trainable_params
    for r in (full, nq, quantized):  # AdamW: two float32 moments per trainable parameter, a step count per tensor
        assert 8 * r.trainable_params < r.optimizer_state_bytes < 8 * r.trainable_params + 4 * 100


def test_loqt_commands_print_their_tables(tiny_workloads, capsys, tmp_path):
    markdown = tmp_path / "pretrain.md"
    assert cli.main(["bench", "loqt", "pretrain", "--steps", "2", "--rank", "4", "--first-interval", "1",
                     "--eval-batches", "1", "--markdown", str(markdown)]) == 0
    printed = capsys.readouterr().out
    for expected in ("full training", "LoQT-nq", "LoQT, no compensation", "LoQT, fixed interval", "vs full",
                     "W bits/param", "optimizer state"):
        assert expected in printed
    assert "| setting | eval loss | vs full |" in markdown.read_text()
    assert cli.main(["bench", "loqt", "memory", "--lora-rank", "4", "--rank", "4", "--pretrain-rank", "8"]) == 0
    printed = capsys.readouterr().out
    for expected in ("full training", "LoRA r=4", "LoQT r=4, only B trains", "4.134", "W + P + adapter"):
        assert expected in printed
