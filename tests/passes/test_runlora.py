import re

import pytest
import torch

from fxmem import Backend, Config
from fxmem.cost_model.lora_orders import BACKWARD_ORDERS, FORWARD_ORDERS, OrderChoice
from fxmem.measure import saved_activation_bytes
from fxmem.passes.joint import runlora as runlora_pass
from fxmem.passes.partitioned import onednn_matmul as onednn_matmul_pass
from tests.conftest import loss_and_grads, randomize_lora_b, tiny_model

SPLIT_DX_ORDERS = ["backward1", "backward2", "backward3", "backward6"]  # dX = dY W + (dY B) A: s B A not in W


def _force(monkeypatch, forward: str, backward: str):
    """Every LoRA linear in the given orders, whatever the cost model would pick."""
    def chooser(shape, needs):
        return OrderChoice(forward, backward, None, None)
    monkeypatch.setattr(runlora_pass, "choose_by_flops", chooser)


def _compiled_grads(model, batch, config, lowering="eager"):
    backend = Backend(config, lowering=lowering)
    loss, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    return backend, loss, grads


@pytest.mark.parametrize("forward, backward", [(f, b) for f in FORWARD_ORDERS for b in BACKWARD_ORDERS
                                               if (f, b) != ("forward1", "backward1")] + [("forward1", "backward1")])
def test_every_order_in_the_joint_graph_gives_the_traced_gradients(monkeypatch, forward, backward):
    model, batch = tiny_model("llama", lora=True)
    model.double()
    reference_loss, reference = loss_and_grads(model, model, batch)
    _force(monkeypatch, forward, backward)
    backend, loss, grads = _compiled_grads(model, batch, Config(runlora="flops"))
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert record.error is None and "14 LoRA linear(s) reordered" in record.note, record
    assert "left as traced" not in record.note
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


@pytest.mark.parametrize("forward, backward", [("forward2", "backward5"), ("forward1", "backward4")])
def test_float32_graph_with_viewed_lora_gradients_gives_the_traced_gradients(monkeypatch, forward, backward):
    model, batch = tiny_model("llama", lora=True)  # float32: the LoRA dX reads a view of (dY B)
    reference_loss, reference = loss_and_grads(model, model, batch)
    _force(monkeypatch, forward, backward)
    backend, loss, grads = _compiled_grads(model, batch, Config(runlora="flops"))
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert "14 LoRA linear(s) reordered" in record.note and "left as traced" not in record.note, record
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def _saved_with_inductor(model, batch, config):
    """The bytes one compiled step saves, and the saved tensors of its region that free memory."""
    torch._dynamo.reset()
    backend = Backend(config)  # inductor lowering
    compiled = torch.compile(model, backend=backend)
    saved, loss = saved_activation_bytes(lambda: compiled(**batch).loss, [*model.parameters(), *batch.values()])
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved, [s for s in backend.regions[0].saved if s.frees_memory]


def test_forward_saves_no_x_a_and_inductor_compiles_it(monkeypatch):
    model, batch = tiny_model("llama", lora=True)

    def saved_lora_intermediates(config):
        saved, tensors = _saved_with_inductor(model, batch, config)
        return saved, [s for s in tensors if s.shape[-1:] == (8,)]

    exact_bytes, exact_rank_wide = saved_lora_intermediates(Config())
    runlora_bytes, runlora_rank_wide = saved_lora_intermediates(Config(runlora="flops"))
    assert exact_rank_wide and not runlora_rank_wide  # x A^T (rank 8) saved by the default only
    # 14 LoRA linears: 2 layers x 7, each x A^T of 2 x 16 tokens x rank 8 floats.
    assert exact_bytes - runlora_bytes == 14 * 2 * 16 * 8 * 4


def _bf16_model_with_fp32_adapters():
    """PEFT's default for a bf16 model: adapters in fp32, x cast to fp32 for them."""
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    model.to(torch.bfloat16)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
    return model, batch


def _reordered_in_forward1_and(monkeypatch, backward, model, batch):
    """(loss, gradients) as traced, then with every LoRA linear in forward1 and ``backward``, which it checks the
    pass applied to all 14 linears. Seeded alike: the same dropout draws in both runs. The fp32 products stay with
    aten: which library runs them is a timing measurement, and in a bf16 model its last-bit differences can round
    to a bf16 step (tests/kernels/test_onednn_matmul.py tests that pass)."""
    _, reference_loss, reference = _compiled_grads(model, batch, Config())
    _force(monkeypatch, "forward1", backward)
    monkeypatch.setattr(onednn_matmul_pass, "cpu_matmul_library", lambda *args, **kwargs: "aten")
    backend, loss, grads = _compiled_grads(model, batch, Config(runlora="flops"))
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert "14 LoRA linear(s) reordered" in record.note and "left as traced" not in record.note, record
    return reference_loss, reference, loss, grads


@pytest.mark.parametrize("backward", SPLIT_DX_ORDERS)
def test_lora_dropout_layers_are_reordered_and_give_the_traced_gradients(monkeypatch, backward):
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1)
    randomize_lora_b(model)
    model.double()
    reference_loss, reference, loss, grads = _reordered_in_forward1_and(monkeypatch, backward, model, batch)
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, msg=name)


@pytest.mark.parametrize("backward", SPLIT_DX_ORDERS)
def test_fp32_adapters_on_a_bf16_model_are_reordered_and_give_the_traced_gradients(monkeypatch, backward):
    model, batch = _bf16_model_with_fp32_adapters()
    reference_loss, reference, loss, grads = _reordered_in_forward1_and(monkeypatch, backward, model, batch)
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        assert grad.dtype == torch.float32 and grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_flops_chooser_keeps_s_b_a_out_of_w_under_dropout_and_fp32_adapters():
    for model, batch in (tiny_model("llama", lora=True, lora_dropout=0.1), _bf16_model_with_fp32_adapters()):
        backend = Backend(Config(runlora="flops"), lowering="eager")
        torch.compile(model, backend=backend)(**batch).loss.backward()
        [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
        assert record.note.startswith("14 LoRA linear(s) reordered"), record
        orders = re.findall(r"r=8: (forward\d)/(backward\d)", record.note)
        assert orders and all(f == "forward1" and b in SPLIT_DX_ORDERS for f, b in orders), record.note


def test_fp32_adapters_on_a_bf16_model_save_neither_x_a_nor_an_fp32_copy_of_x():
    model, batch = _bf16_model_with_fp32_adapters()

    def saved(config):
        saved_bytes, tensors = _saved_with_inductor(model, batch, config)
        fp32_lora_inputs = [s for s in tensors if s.dtype == "float32" and s.shape in ((32, 64), (32, 172))]
        return saved_bytes, fp32_lora_inputs, [s for s in tensors if s.shape == (32, 8)]

    exact_bytes, exact_fp32_inputs, exact_x_a = saved(Config())
    runlora_bytes, runlora_fp32_inputs, runlora_x_a = saved(Config(runlora="flops"))
    # every preset saves x, not its fp32 copy (passes/joint/adapter_cast.py); autograd's order keeps x A^T
    assert len(exact_x_a) == 14 and not exact_fp32_inputs
    assert not runlora_x_a and not runlora_fp32_inputs  # runlora rebuilds x A^T from the bf16 x in backward
    assert exact_bytes - runlora_bytes >= 14 * 32 * 8 * 4  # 14 x A^T (32 tokens x rank 8, fp32)


def test_a_layer_the_pass_cannot_follow_is_left_as_traced_and_named(lenient):
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    model.double()
    for name, parameter in model.named_parameters():
        if "lora_B" in name:
            parameter.requires_grad_(False)  # no dB: the pass finds the LoRA branch's gradient through it
    _, reference_loss, reference = _compiled_grads(model, batch, Config())
    backend, loss, grads = _compiled_grads(model, batch, Config(runlora="flops"))
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert record.note.startswith("0 LoRA linear(s) reordered") and record.note.count("no gradient for B") == 14
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
