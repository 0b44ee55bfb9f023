"""`fxmem bench hift`: HiFT against full fine-tuning on the same batches and on as many updates."""

import pytest

from fxmem import cli
from fxmem_bench.hift import compare_hift
from tests.bench.conftest import TINY_LLAMA


def test_comparison_accounts_gradients_and_state_per_step(tiny_workloads, tmp_path, capsys):
    same_batches, same_updates, hift = compare_hift(TINY_LLAMA, ["bottom2up"], cycles=2, lr=1e-3)
    assert [(r.name, r.groups, r.steps) for r in (same_batches, same_updates, hift)] == [
        ("full, same batches", 1, 8), ("full, same updates", 1, 2), ("HiFT bottom2up", 4, 8)]
    weights = sum(p.numel() * 4 for p in TINY_LLAMA.build(lora_rank=0).model.parameters())
    adam = 2 * weights + 4 * 21  # two moments per weight; a float32 step count for each of the 21 tensors
    assert same_batches.gradient_bytes == [weights] * 8 and same_batches.device_state_bytes == [adam] * 8
    assert sum(hift.gradient_bytes[:4]) == weights and hift.gradient_bytes[:4] == hift.gradient_bytes[4:]
    assert hift.device_state_bytes[-1] + hift.offloaded_state_bytes[-1] == adam
    assert hift.losses[0] == same_batches.losses[0] == same_updates.losses[0]  # same weights and first batch
    assert same_updates.losses == same_batches.losses[:2]  # both schedules start at the peak LR
    assert hift.step_peak_bytes < same_batches.step_peak_bytes
    assert all(0 < r.eval_loss < r.losses[0] for r in (same_batches, same_updates, hift))  # all of them learn

    out = tmp_path / "hift.md"
    assert cli.main(["bench", "hift", "--cycles", "2", "--orders", "top2down", "--markdown", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "HiFT top2down" in printed and "2 cycles of k=4 steps" in printed
    assert "| full, same updates | 1 | 2 |" in out.read_text()


def test_comparison_refuses_bad_choices():
    with pytest.raises(ValueError, match="unknown order 'up'; valid orders: bottom2up, top2down, random"):
        compare_hift(TINY_LLAMA, ["up"], cycles=2, lr=1e-3)
    with pytest.raises(ValueError, match="unknown compile backend 'xla'; valid: none, fxmem, inductor"):
        compare_hift(TINY_LLAMA, cycles=2, lr=1e-3, compile_backend="xla")
    with pytest.raises(ValueError, match="cycles must be >= 2"):
        compare_hift(TINY_LLAMA, cycles=1, lr=1e-3)
