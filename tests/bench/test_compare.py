import dataclasses

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._inductor.compile_fx import compile_fx
from torch.utils.checkpoint import CheckpointPolicy

from fxmem import Config
from fxmem.bench import compare
from fxmem.bench.compare import (
    _sac_policy,
    budget_bracket,
    default_methods,
    forward_for_method,
    inductor_saved_bytes,
    run_workload,
)
from fxmem.measure import model_tensors, saved_activation_bytes
from tests.conftest import TINY_LLAMA

ONE_LAYER = dataclasses.replace(TINY_LLAMA, llama=dataclasses.replace(TINY_LLAMA.llama, layers=1))


def test_budget_bracket_has_one_setting_at_or_below_the_target_and_one_above():
    full = inductor_saved_bytes(ONE_LAYER, torch.device("cpu"), 16, budget=1.0)
    target = full // 2
    bracket = budget_bracket(ONE_LAYER, target, torch.device("cpu"), 16, iterations=2)
    assert 0.0 <= bracket.below < bracket.above <= 1.0 and bracket.above - bracket.below == 1 / 4
    below, above = (inductor_saved_bytes(ONE_LAYER, torch.device("cpu"), 16, b) for b in bracket.budgets)
    assert below <= target < above
    # measured as prepare_method measures every method: what the real inductor compile saves at 1.0
    compiled_setup = ONE_LAYER.build()
    next(compiled_setup.batches)
    batch = next(compiled_setup.batches)
    compiled = forward_for_method("compile-budget", compiled_setup.model, Config(), budget=1.0)
    exclude = model_tensors(compiled_setup.model) + list(batch.values())
    assert saved_activation_bytes(lambda: compiled_setup.loss(compiled, batch), exclude)[0] == full


def test_run_workload_refuses_unknown_methods_and_what_cannot_run():
    with pytest.raises(ValueError, match="unknown method.*valid methods: eager, compile"):
        run_workload(TINY_LLAMA, methods=["eager", "deepspeed"])
    with pytest.raises(ValueError, match="compile-offload runs on CUDA only.*got device cpu"):
        run_workload(TINY_LLAMA, methods=["eager", "compile-offload"])
    with pytest.raises(ValueError, match="compile-budget is matched to fxmem's measured saved bytes: add fxmem"):
        run_workload(TINY_LLAMA, methods=["eager", "compile-budget"])
    assert "compile-offload" not in default_methods("cpu") and "compile-offload" in default_methods("cuda")


def test_offload_baseline_copies_the_saved_activations_out_and_back(monkeypatch):
    """The mechanics on CPU (a copy to the same device): the saved activations leave the forward graph through
    inductor's offload copies and come back in backward; gradients are torch's."""
    graphs = []

    def keep_graph(gm, example_inputs, **kwargs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    monkeypatch.setattr(compare, "compile_fx", lambda gm, inputs: compile_fx(gm, inputs, inner_compile=keep_graph))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    forward_for_method("compile-offload", model, Config())(x).square().sum().backward()
    forward, backward = graphs
    assert forward.count("device_put") >= 2 and "cpu_offload_" in forward
    assert backward.count("device_put") == forward.count("device_put")
    for parameter, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(parameter.grad, grad)


def test_checkpointing_baselines_are_hf_checkpointing_compiled_and_sac_saving_the_matmuls():
    assert _sac_policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert _sac_policy(None, torch.ops.aten.mul.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE

    def saved(method: str) -> int:
        torch._dynamo.reset()
        setup = ONE_LAYER.build()
        batch = next(setup.batches)
        forward = forward_for_method(method, setup.model, Config())
        assert isinstance(forward, torch._dynamo.eval_frame.OptimizedModule) and forward._orig_mod is setup.model
        # the policy the method put on the model, compiled without inductor's code generation (seconds, not a
        # minute): what SAC stores becomes the compiled graph's saved tensors, which eager SAC's storage hides
        compiled = torch.compile(setup.model, backend="aot_eager")
        exclude = model_tensors(setup.model) + list(batch.values())
        return saved_activation_bytes(lambda: setup.loss(compiled, batch), exclude)[0]

    whole, selective = saved("compile-checkpointing"), saved("compile-sac")
    # checkpointing keeps each layer's input; SAC also every matmul's output (measured with inductor: 0.11 against
    # 0.80 MiB, torch.compile alone 0.63)
    assert 2 * whole < selective
