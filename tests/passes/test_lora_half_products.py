"""lora_half_products: PEFT's fp32 adapters on a bf16 model, their products with bf16 inputs."""

import pytest
import torch

from fxmem import Backend, Config
from fxmem.analysis.graph import aten
from fxmem.cost_model.matmul_library import half_tensor_cores
from fxmem.measure import gradient_fidelity
from fxmem.passes import GraphPass, PassManager, PassResult
from fxmem.passes.partitioned import lora_half_products
from fxmem.techniques import default_passes
from tests.conftest import randomize_lora_b, tiny_model

# 2 layers x 7 PEFT linears; forward: x A^T and its B product each; backward: B's and A's gradients and the
# gradient through B, and x's gradient through A where x needs one (not layer 0's q, k and v, whose input comes
# from the frozen embedding through a norm with a frozen weight)
FORWARD, BACKWARD = 2 * 7 * 2, 2 * 7 * 4 - 3


def _model():
    model, batch = tiny_model("llama", lora=True, dtype=torch.bfloat16, kv_heads=2)  # PEFT: fp32 adapters
    randomize_lora_b(model)
    return model, batch


class _Fp32Products(GraphPass):
    """Counts the float32 matrix products of the finished partitioned graphs (appended after fxmem's passes)."""

    name = "fp32_products"
    stage = "partitioned"

    def __init__(self):
        self.count = 0

    def run(self, state):
        self.count = sum(node.meta["val"].dtype == torch.float32 for gm in (state.fw, state.bw)
                         for node in gm.graph.find_nodes(op="call_function", target=aten.mm.default))
        return PassResult(False)


def _backend(config):
    counter = _Fp32Products()
    return Backend(config, lowering="eager", passes=PassManager([*default_passes(), counter])), counter


def _grads(model, batch, backend):
    torch._dynamo.reset()
    forward = model if backend is None else torch.compile(model, backend=backend)
    forward(**batch).loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def test_every_lora_product_runs_with_bf16_inputs_and_the_gradients_stay_close():
    model, batch = _model()
    eager = _grads(model, batch, None)
    off, off_products = _backend(Config())
    _grads(model, batch, off)
    backend, products = _backend(Config(lora_half_products="on"))
    grads = _grads(model, batch, backend)
    [record] = [r for r in backend.regions[0].passes if r.name == "lora_half_products"]
    assert record.note == (f"{FORWARD + BACKWARD} LoRA product(s) of fp32 adapters run with bfloat16 inputs and "
                              f"float32 accumulation (as configured)")
    # every fp32 product of the graphs was a LoRA product: none is left
    assert off_products.count == FORWARD + BACKWARD and products.count == 0
    # the adapters and their gradients stay fp32; each product's result rounded to bf16 once
    assert all(grad.dtype == torch.float32 for grad in grads.values())
    assert gradient_fidelity(eager, grads).min_cosine > 0.999


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_auto_is_a_rule_on_the_device_not_a_timing(monkeypatch, tensor_cores):
    devices = []

    def rule(device):
        devices.append(torch.device(device))
        return tensor_cores

    monkeypatch.setattr(lora_half_products, "half_tensor_cores", rule)
    model, batch = _model()
    backend, products = _backend(Config(lora_half_products="auto"))
    _grads(model, batch, backend)
    [record] = [r for r in backend.regions[0].passes if r.name == "lora_half_products"]
    assert devices == [torch.device("cpu")]  # asked once per region, of the graph's device
    if tensor_cores:
        assert products.count == 0
        assert record.note == (f"{FORWARD + BACKWARD} LoRA product(s) of fp32 adapters run with bfloat16 inputs "
                                  f"and float32 accumulation (the device has bf16 tensor cores)")
    else:  # nothing changed, and nothing claims a measurement
        assert products.count == FORWARD + BACKWARD and record.note == ""


def test_a_cpu_has_no_bf16_tensor_cores_whatever_its_instructions():
    assert not half_tensor_cores("cpu")


def test_an_fp32_model_is_left_alone():
    model, batch = tiny_model("llama", lora=True)
    backend = Backend(Config(lora_half_products="on"), lowering="eager")
    _grads(model, batch, backend)
    assert not [r for r in backend.regions[0].passes if r.name == "lora_half_products" and r.note]


def test_a_bad_choice_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"lora_half_products must be one of 'off', 'auto', 'on'; got 'tf32'"):
        Config(lora_half_products="tf32")
