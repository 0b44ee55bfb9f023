"""fxmem.check_fidelity: gradients under a preset against eager's, and each compressed tensor's share of the error."""

import dataclasses

import pytest
import torch

from fxmem import check_fidelity
from fxmem.kernels import probe
from tests.models import TINY_BF16


@pytest.fixture(scope="module")
def bf16_model():
    return TINY_BF16.build()


def test_every_parameter_is_compared_and_every_compressed_tensor_probed(bf16_model):
    model, batch = bf16_model
    before = set(probe.COMPRESSED)
    report = check_fidelity(model, batch, "hyclora-4bit")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(p.name for p in report.parameters) == sorted(trainable)
    assert [p.cosine for p in report.parameters] == sorted(p.cosine for p in report.parameters)
    assert 0.98 < report.min_cosine < 1.0 and report.worst_parameter == report.parameters[0].name
    assert report.tensors and [t.min_cosine for t in report.tensors] == sorted(t.min_cosine for t in report.tensors)
    assert {t.plan.split(",")[0] for t in report.tensors} <= {"4-bit codes", "8-bit codes",
                                                             "rebuilt from its norm output's 8-bit codes"}
    # each compressed tensor probed once, the worst alone naming the gradient it bends most
    assert len({(t.region, t.tensor) for t in report.tensors}) == len(report.tensors)
    assert report.tensors[0].worst_parameter in trainable
    assert report.tensors[0].min_cosine < report.tensors[-1].min_cosine
    assert set(probe.COMPRESSED) == before  # the check's probes are released
    assert all(p.grad is None for p in model.parameters())
    assert "Each compressed tensor alone" in report.table() and report.to_dict()["tensors"]


def test_probes_do_not_change_what_the_compressed_run_computes(bf16_model):
    model, batch = bf16_model
    probed = check_fidelity(model, batch, "hyclora-4bit")
    plain = check_fidelity(model, batch, "hyclora-4bit", per_tensor=False)
    assert not plain.tensors
    assert [(p.name, p.cosine, p.relative_error) for p in probed.parameters] == \
        [(p.name, p.cosine, p.relative_error) for p in plain.parameters]


def test_an_exact_preset_probes_nothing_and_matches_eager():
    model, batch = dataclasses.replace(TINY_BF16, dtype=torch.float32).build()
    report = check_fidelity(model, batch, "exact")
    assert not report.tensors and report.min_cosine > 0.99999


def test_a_model_output_without_a_loss_is_refused_clearly(bf16_model):
    model, batch = bf16_model
    with pytest.raises(TypeError, match="the model's output has no loss: pass labels in the batch, or loss="):
        check_fidelity(model, {"input_ids": batch["input_ids"]}, "hyclora-4bit")
    with pytest.raises(ValueError, match="unknown preset 'fast'; valid presets: exact"):
        check_fidelity(model, batch, "fast")


def test_parameters_with_a_zero_exact_gradient_are_listed_apart_not_compared():
    model, batch = dataclasses.replace(TINY_BF16, lora_b_std=0.0, dtype=torch.float32).build()  # PEFT's B = 0
    report = check_fidelity(model, batch, "hyclora-4bit", per_tensor=False)
    lora_a = sorted(n for n, p in model.named_parameters() if "lora_A" in n)
    assert sorted(report.zero_gradients) == lora_a
    assert all("lora_B" in p.name for p in report.parameters) and len(report.parameters) == len(lora_a)
    assert f"{len(lora_a)} parameters not compared, their exact gradient is zero" in report.table()
    assert report.to_dict()["zero_gradients"] == report.zero_gradients


def test_a_compiled_model_is_refused(bf16_model):
    model, batch = bf16_model
    with pytest.raises(ValueError, match="check_fidelity needs the model itself, not a compiled one"):
        check_fidelity(torch.compile(model), batch, "hyclora-4bit")
