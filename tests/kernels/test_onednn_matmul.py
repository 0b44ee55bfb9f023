import pytest
import torch
from torch._inductor.utils import run_and_get_code

from fxmem import Backend, Config
from fxmem.cost_model import matmul_library
from fxmem.kernels.onednn_matmul import (
    MATMUL_LIBRARIES,
    ONEDNN_MM,
    matmul,
    onednn_applies,
    onednn_available,
    onednn_mm,
    onednn_mm_reference,
)
from fxmem.kernels.runlora import runlora_linear
from fxmem.passes.partitioned import onednn_matmul as onednn_pass
from tests.conftest import loss_and_grads, tiny_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows, inner, cols", [(64, 48, 40), (1, 7, 3), (130, 256, 17)])
@pytest.mark.parametrize("b_layout", ["row-major", "transposed view"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_product_equals_aten_to_float_rounding(rows, inner, cols, b_layout, with_bias):
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=generator)
    b = (torch.randn(inner, cols, generator=generator) if b_layout == "row-major"
         else torch.randn(cols, inner, generator=generator).t())
    bias = torch.randn(cols, generator=generator) if with_bias else None
    assert onednn_applies(a, b)
    torch.testing.assert_close(onednn_mm(a, b, bias), onednn_mm_reference(a, b, bias), rtol=1e-5, atol=1e-5)


def test_onednn_product_falls_back_to_aten_where_onednn_cannot_run_it():
    a = torch.randn(8, 6, dtype=torch.float64)
    b = torch.randn(6, 5, dtype=torch.float64)
    assert not onednn_applies(a, b)
    assert torch.equal(onednn_mm(a, b), a @ b)
    strided = torch.randn(6, 10)[:, ::2]  # neither row- nor column-major: handed over as compiled code may do
    assert not onednn_applies(a.float(), strided)
    assert torch.equal(onednn_mm(a.float(), strided), a.float() @ strided)


def test_unknown_library_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="valid libraries: aten, onednn"):
        matmul(torch.randn(2, 3), torch.randn(3, 4), library="mkl")


def test_onednn_op_passes_opcheck():
    a, b, bias = torch.randn(16, 12), torch.randn(10, 12).t(), torch.randn(10)
    torch.library.opcheck(ONEDNN_MM, (a, b, bias))
    torch.library.opcheck(ONEDNN_MM, (a, b.contiguous(), None))


def test_library_is_measured_once_per_shape_and_layout_with_rows_capped(monkeypatch):
    measured = []
    real = matmul_library.interleaved_step_times

    def spy(steps_by_name, **kwargs):
        measured.append(sorted(steps_by_name))
        return real(steps_by_name, **kwargs)

    monkeypatch.setattr(matmul_library, "interleaved_step_times", spy)
    monkeypatch.setattr(matmul_library, "_CHOICES", {})
    rows = matmul_library.MAX_PROBE_ROWS * 4
    first = matmul_library.cpu_matmul_library(rows, 32, 24, b_transposed=True)
    assert first in MATMUL_LIBRARIES and measured == [["aten", "onednn"]]
    # more rows than the probe takes share its answer: the rows do not change which library wins
    assert matmul_library.cpu_matmul_library(rows * 2, 32, 24, b_transposed=True) == first
    assert len(measured) == 1
    matmul_library.cpu_matmul_library(rows, 32, 24, b_transposed=False)
    assert len(measured) == 2
    # wide products probe fewer rows (PROBE_FLOPS per run), never under MIN_PROBE_ROWS unless the product has fewer
    monkeypatch.setattr(matmul_library, "PROBE_FLOPS", 2 * 32 * 24 * 300)
    for rows_asked, rows_probed in ((rows, 300), (299, 299), (100, 100)):
        matmul_library.cpu_matmul_library(rows_asked, 32, 24, b_transposed=True)
        assert (rows_probed, 32, 24, True, torch.float32) in matmul_library._CHOICES
    monkeypatch.setattr(matmul_library, "PROBE_FLOPS", 1)
    matmul_library.cpu_matmul_library(rows, 32, 24, b_transposed=True)
    assert (matmul_library.MIN_PROBE_ROWS, 32, 24, True, torch.float32) in matmul_library._CHOICES
    measured.clear()
    for dtype in (torch.float64, torch.bfloat16):  # oneDNN's fp32 product is the only candidate
        assert matmul_library.cpu_matmul_library(64, 32, 24, b_transposed=True, dtype=dtype) == "aten"
    assert measured == []


def _always(monkeypatch, library):
    monkeypatch.setattr(onednn_pass, "cpu_matmul_library", lambda *args, **kwargs: library)


def _onednn_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The weight shapes oneDNN's linear runs on from now on."""
    calls = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(*args):
        calls.append(tuple(args[1].shape))
        return real(*args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    return calls


def test_pass_hands_each_product_oneDNN_won_to_it_and_gradients_stay(monkeypatch):
    model, batch = tiny_model("llama", lora=True)
    reference_loss, reference = loss_and_grads(model, model, batch)
    _always(monkeypatch, "onednn")
    calls = _onednn_calls(monkeypatch)
    backend = Backend(Config(runlora="flops"), lowering="eager")
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    [record] = [r for r in backend.regions[0].passes if r.name == "onednn_matmul"]
    moved, total = (int(word) for word in record.note.split()[:3:2])
    assert record.error is None and record.note.endswith("run by oneDNN (measured faster than aten's here)")
    # every product but those with a transposed left operand: the weight gradients (x^T G, G^T (x A^T))
    assert 0 < moved < total and len(calls) == moved  # each graph ran once
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_pass_leaves_products_where_aten_won_and_stays_off_without_runlora(monkeypatch):
    model, batch = tiny_model("llama", lora=True, layers=1)
    _always(monkeypatch, "aten")
    calls = _onednn_calls(monkeypatch)
    backend = Backend(Config(runlora="flops"), lowering="eager")
    loss_and_grads(torch.compile(model, backend=backend), model, batch)
    [record] = [r for r in backend.regions[0].passes if r.name == "onednn_matmul"]
    assert record.note == "" and calls == []
    _always(monkeypatch, "onednn")
    torch._dynamo.reset()
    backend = Backend(Config(), lowering="eager")
    loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert "onednn_matmul" not in [r.name for r in backend.regions[0].passes] and calls == []


def test_inductor_keeps_the_onednn_product_as_one_extern_call(monkeypatch):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    model = get_peft_model(torch.nn.Sequential(torch.nn.Linear(32, 48)), LoraConfig(r=4, target_modules=["0"]))
    torch.nn.init.normal_(model.base_model.model[0].lora_B["default"].weight)
    x = torch.randn(3, 8, 32, requires_grad=True)
    model(x).square().sum().backward()
    reference = [t.grad.clone() for t in (x, *[p for p in model.parameters() if p.requires_grad])]
    for t in (x, *model.parameters()):
        t.grad = None
    _always(monkeypatch, "onednn")
    backend = Backend(Config(runlora="flops"), lowering="inductor")
    _, (forward_code, backward_code) = run_and_get_code(
        lambda: torch.compile(model, backend=backend)(x).square().sum().backward())
    region = backend.regions[0]
    assert "run by oneDNN" in {r.name: r.note for r in region.passes}["onednn_matmul"]
    # lowered by inductor, not run as aten ops after a failure
    assert not [note for note in region.notes if "could not lower" in note], region.notes
    assert "torch.ops.fxmem.onednn_mm.default" in forward_code  # X W^T
    assert "torch.ops.fxmem.onednn_mm.default" in backward_code  # dY W
    got = [t.grad for t in (x, *[p for p in model.parameters() if p.requires_grad])]
    for ref, grad in zip(reference, got, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-5)


def test_runlora_linear_runs_its_products_with_w_in_the_libraries_given(monkeypatch):
    calls = _onednn_calls(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(2, 16, 24, requires_grad=True)
    weight, lora_a, lora_b = torch.randn(40, 24), torch.randn(4, 24, requires_grad=True), torch.randn(40, 4)
    lora_b.requires_grad_()
    runlora_linear(x, weight, None, lora_a, lora_b, 2.0, "forward1", "backward1",
                   ("onednn", "onednn")).square().sum().backward()
    got = [t.grad.clone() for t in (x, lora_a, lora_b)]
    # oneDNN's linear takes the weight as (out, in): W in forward, W^T for dY W in backward
    assert calls == [(40, 24), (24, 40)]
    for t in (x, lora_a, lora_b):
        t.grad = None
    (torch.nn.functional.linear(x, weight) + 2.0 * torch.nn.functional.linear(torch.nn.functional.linear(x, lora_a),
                                                                              lora_b)).square().sum().backward()
    for grad, t in zip(got, (x, lora_a, lora_b), strict=True):
        torch.testing.assert_close(grad, t.grad, rtol=1e-4, atol=1e-4)


def test_weight_libraries_measure_the_forward_and_the_backward_product_with_w(monkeypatch):
    asked = []
    monkeypatch.setattr(matmul_library, "cpu_matmul_library",
                        lambda *args, **kwargs: asked.append((*args, kwargs["b_transposed"])) or "onednn")
    assert matmul_library.weight_libraries(torch.randn(2, 16, 24), torch.randn(40, 24)) == ("onednn", "onednn")
    assert asked == [(32, 24, 40, True), (32, 40, 24, False)]  # X W^T with W^T a view; dY W with W row-major


def test_inspect_leaves_the_library_choice_out(monkeypatch):
    import fxmem
    probed = []
    monkeypatch.setattr(onednn_pass, "cpu_matmul_library", lambda *args, **kwargs: probed.append(args) or "onednn")
    model, batch = tiny_model("llama", lora=True, layers=1)
    report = fxmem.inspect(model, config=Config(runlora="flops"), **batch)
    passes = [r.name for r in report.regions[0].passes]
    assert "runlora" in passes and "onednn_matmul" not in passes and probed == []
