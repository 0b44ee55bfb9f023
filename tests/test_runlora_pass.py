import pytest
import torch

from fxmem import Backend, Config
from fxmem.cost_model.lora_orders import BACKWARD_ORDERS, FORWARD_ORDERS, OrderChoice
from fxmem.measure import saved_activation_bytes
from fxmem.passes import runlora as runlora_pass

from .conftest import loss_and_grads, tiny_model


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
    assert record.error is None and "14 LoRA linear(s) reordered" in record.summary, record
    assert "left as traced" not in record.summary
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
    assert "14 LoRA linear(s) reordered" in record.summary and "left as traced" not in record.summary, record
    torch.testing.assert_close(loss, reference_loss)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_forward_saves_no_x_a_and_inductor_compiles_it(monkeypatch):
    model, batch = tiny_model("llama", lora=True)
    params_and_inputs = [*model.parameters(), *batch.values()]

    def saved_lora_intermediates(config):
        torch._dynamo.reset()
        backend = Backend(config)  # inductor lowering
        compiled = torch.compile(model, backend=backend)
        saved, loss = saved_activation_bytes(lambda: compiled(**batch).loss, params_and_inputs)
        loss.backward()
        model.zero_grad(set_to_none=True)
        rank_wide = [s for s in backend.regions[0].saved if s.shape[-1:] == (8,) and s.frees_memory]
        return saved, rank_wide

    exact_bytes, exact_rank_wide = saved_lora_intermediates(Config())
    runlora_bytes, runlora_rank_wide = saved_lora_intermediates(Config(runlora="flops"))
    assert exact_rank_wide and not runlora_rank_wide  # x A^T (rank 8) saved by the default only
    # 14 LoRA linears: 2 layers x 7, each x A^T of 2 x 16 tokens x rank 8 floats.
    assert exact_bytes - runlora_bytes == 14 * 2 * 16 * 8 * 4


def test_the_flops_chooser_decides_per_shape_and_lora_dropout_is_left_as_traced():
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1)
    model.double()
    backend = Backend(Config(runlora="flops"), lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert record.summary.startswith("0 LoRA linear(s) reordered")
    assert "left as traced" in record.summary and "dropout on the LoRA input" in record.summary


def test_adapters_in_another_dtype_than_the_model_are_left_as_traced_and_named():
    # PEFT's default for a bf16 model: adapters in fp32, x cast to fp32 for them.
    model, batch = tiny_model("llama", lora=True)
    model.to(torch.bfloat16)
    for name, parameter in model.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
    backend = Backend(Config(runlora="flops"), lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert record.summary.startswith("0 LoRA linear(s) reordered")
    assert record.summary.count("LoRA input cast from torch.bfloat16 to the adapters' torch.float32") == 14
    assert "dropout" not in record.summary
