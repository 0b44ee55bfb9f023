"""fxmem bench ablate: settings, probes and the loss/bytes bookkeeping, on a tiny workload."""

import pytest

from fxmem.config import Config
from fxmem_bench.ablation import ablate, hyclora_settings, loract_settings, probe_steps, select_settings
from tests.bench.conftest import ONE_LAYER_LLAMA


def test_settings_cover_bits_intra_inter_outliers_and_the_papers_static_calibration():
    settings = hyclora_settings([4, 2])
    names = [s.name for s in settings]
    assert names == ["eager PEFT", "torch.compile", "4-bit intra + inter", "4-bit intra", "4-bit intra, no outliers",
                     "4-bit inter", "4-bit intra + inter, rotated", "4-bit intra + inter, stochastic",
                     "4-bit intra + inter, rebuilt from x",
                     "2-bit intra + inter", "2-bit intra", "2-bit intra, no outliers", "2-bit inter",
                     "2-bit intra + inter, rotated", "2-bit intra + inter, stochastic",
                     "2-bit intra + inter, rebuilt from x",
                     "4-bit intra + inter, q/k/v 4-bit", "4-bit intra + inter, static"]
    by_name = {s.name: s.config for s in settings}

    def unguarded(preset, **overrides):  # the ablation measures each setting by itself, without the preset's guard
        return Config.from_preset(preset, guard=False, guard_cosine=Config().guard_cosine, **overrides)

    paper = unguarded("hyclora-2bit", rebuild_from_x=False)  # the preset is the paper's, rebuilt from x
    assert by_name["2-bit intra + inter, rebuilt from x"] == unguarded("hyclora-2bit")
    assert by_name["2-bit intra + inter"] == paper
    assert by_name["2-bit intra + inter, rotated"] == paper.replace(rotation=64)
    assert by_name["4-bit intra + inter, stochastic"] == unguarded("hyclora-4bit", stochastic_rounding=True,
                                                                   rebuild_from_x=False)
    assert (by_name["4-bit intra"].lora_reorder, by_name["4-bit intra"].intra) == (False, True)
    assert (by_name["4-bit inter"].lora_reorder, by_name["4-bit inter"].intra) == (True, False)
    assert (by_name["4-bit intra, no outliers"].outlier_ratio, by_name["4-bit intra, no outliers"].outlier_values) == (
        0.0, 0.0)
    paper_qk, static = (s.config for s in hyclora_settings([4])[-2:])
    assert (paper_qk.bits, paper_qk.qkv_bits, paper_qk.calibration) == (4, None, "dynamic")
    assert (static.bits, static.qkv_bits, static.calibration, static.outlier_ratio) == (4, 8, "static", 0.005)
    assert probe_steps(200, 5) == [6, 100, 200]


def test_loract_settings_pair_pre_norm_sharing_with_layer_wise_and_factored_qkv_per_ratio():
    settings = loract_settings([0.25, 8])
    assert [s.name for s in settings] == ["eager PEFT", "torch.compile", "lowrank 0.25, pre-norm",
                                          "lowrank 0.25, layer-wise", "lowrank 0.25, q/k/v factored",
                                          "lowrank 8, pre-norm", "lowrank 8, layer-wise", "lowrank 8, q/k/v factored"]
    assert settings[2].config == Config.from_preset("loract", lowrank=0.25)
    assert [(s.config.lowrank, s.config.prenorm_sharing, s.config.bits) for s in settings[3:]] == [
        (0.25, False, 8), (0.25, True, None), (8, True, 8), (8, False, 8), (8, True, None)]


@pytest.mark.parametrize("argv, message", [
    (["--technique", "loract", "--bits", "4"], "--bits does not apply to --technique loract"),
    (["--ratios", "0.25"], "--ratios does not apply to --technique hyclora"),
    (["--technique", "loract", "--ratios", "0.25", "8", "0.25"], "ratios: each value once; repeated: 0.25"),
    (["--bits", "2", "2"], "bits: each value once; repeated: 2"),
])
def test_ablate_command_refuses_options_that_do_not_apply_and_repeated_values(tiny_workloads, capsys, argv, message):
    from fxmem import cli
    assert cli.main(["bench", "ablate", "--steps", "3", *argv]) == 2
    assert message in capsys.readouterr().out.replace("\n", " ")


def test_select_settings_keeps_the_baselines_and_names_the_valid_choices():
    settings = hyclora_settings([4, 2])
    chosen = select_settings(settings, ["2-bit inter", "4-bit intra"])
    assert [s.name for s in chosen] == ["eager PEFT", "torch.compile", "4-bit intra", "2-bit inter"]
    with pytest.raises(ValueError, match="unknown setting '3-bit'; valid settings: '4-bit intra \\+ inter', "):
        select_settings(settings, ["3-bit"])


def test_ablate_trains_every_setting_on_the_same_batches_and_probes_the_compressed_ones():
    settings = [s for s in hyclora_settings([4]) if s.name in ("eager PEFT", "4-bit intra + inter")]
    # one block: each setting compiles with inductor, and what is tested is the bookkeeping across settings
    eager, four = ablate(ONE_LAYER_LLAMA, settings, steps=3, lora_rank=4)
    assert eager.losses[0] == pytest.approx(four.losses[0], rel=1e-5)  # the same weights and first batch
    assert four.losses[1:] != eager.losses[1:]  # then each trains with its own gradients
    assert four.saved_bytes * 3 < eager.saved_bytes
    assert eager.probes == [] and len(four.probes) == 2  # steps 3 (calibration ends later) and 1: {3, 1}
    assert 0.5 < four.min_cosine <= 1.0
