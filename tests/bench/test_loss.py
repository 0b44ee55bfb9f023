import pytest

from fxmem import cli
from fxmem_bench.loss import LOSS_METHODS, LossShape, run_loss


def test_every_loss_method_matches_the_unfused_loss_and_fxmem_holds_less_than_the_whole_logits():
    results = run_loss(LossShape(tokens=1024, hidden=32, vocab=2048), steps=1)
    assert [r.method for r in results] == list(LOSS_METHODS)
    by_method = {r.method: r for r in results}
    for r in results:
        assert r.loss_error < 1e-5 and r.grad_error < 1e-4, r.method
        assert len(r.step_samples) == 1
    fxmem = by_method["fxmem"]
    for whole in ("unfused", "unfused-compile", "linear-cross-entropy"):
        assert fxmem.peak_bytes < by_method[whole].peak_bytes / 2, whole
    assert fxmem.peak_bytes < 1024 * 2048 * 4 / 2  # four chunks of 256 rows: a quarter of the logits, and the gradient


def test_unknown_loss_methods_are_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="unknown loss method\\(s\\) nope; valid methods: unfused, "):
        run_loss(LossShape(8, 4, 16), methods=("nope",))


def test_bench_loss_command_prints_the_table(capsys):
    assert cli.main(["bench", "loss", "--tokens", "64", "--hidden", "8", "--vocab", "128", "--steps", "1",
                     "--methods", "unfused", "fxmem"]) == 0
    printed = capsys.readouterr().out
    assert "fxmem bench loss" in printed and "64 tokens, hidden 8, vocabulary 128" in printed
