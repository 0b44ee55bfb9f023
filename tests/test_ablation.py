"""fxmem ablate: settings, probes and the loss/bytes bookkeeping, on a tiny workload."""

import pytest

from fxmem.ablation import ablate, hyclora_settings, probe_steps

from .conftest import TINY_LLAMA


def test_settings_cover_bits_outliers_and_the_papers_static_calibration():
    names = [s.name for s in hyclora_settings([4, 2])]
    assert names == ["eager PEFT", "torch.compile", "4-bit + outliers", "4-bit, no outliers", "2-bit + outliers",
                     "2-bit, no outliers", "4-bit + outliers, q/k 4-bit", "4-bit + outliers, static"]
    paper_qk, static = (s.config for s in hyclora_settings([4])[-2:])
    assert (paper_qk.bits, paper_qk.qk_bits, paper_qk.calibration) == (4, None, "dynamic")
    assert (static.bits, static.qk_bits, static.calibration, static.outlier_ratio) == (4, 8, "static", 0.005)
    assert probe_steps(200, 5) == [6, 100, 200]


def test_ablate_trains_every_setting_on_the_same_batches_and_probes_the_compressed_ones():
    settings = [s for s in hyclora_settings([4]) if s.name in ("eager PEFT", "torch.compile", "4-bit + outliers")]
    eager, compiled, four = ablate(TINY_LLAMA, settings, steps=3, lora_rank=4)
    assert eager.losses[0] == pytest.approx(compiled.losses[0], rel=1e-5) == pytest.approx(four.losses[0], rel=1e-5)
    assert four.saved_bytes * 3 < compiled.saved_bytes < eager.saved_bytes
    assert eager.probes == [] and len(four.probes) == 2  # steps 3 (calibration ends later) and 1: {3, 1}
    assert 0.5 < four.min_cosine <= 1.0
