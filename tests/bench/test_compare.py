import dataclasses

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from fxmem import Config
from fxmem.bench.compare import _sac_policy, budget_matching, forward_for_method, planned_bytes, run_workload
from fxmem.measure import model_tensors, saved_activation_bytes
from tests.conftest import TINY_LLAMA


def test_budget_search_finds_a_budget_below_one_for_a_smaller_target():
    full = planned_bytes(TINY_LLAMA, Config(), "cpu", 16)
    budget = budget_matching(TINY_LLAMA, full // 2, "cpu", 16, iterations=4)
    assert 0.0 <= budget < 1.0
    assert planned_bytes(TINY_LLAMA, Config(), "cpu", 16, budget=budget) <= full // 2


def test_run_workload_rejects_unknown_methods():
    with pytest.raises(ValueError, match="unknown method.*valid methods: eager, compile"):
        run_workload(TINY_LLAMA, methods=["eager", "deepspeed"])


def test_checkpointing_baselines_are_hf_checkpointing_compiled_and_sac_saving_the_matmuls():
    assert _sac_policy(None, torch.ops.aten.mm.default) is CheckpointPolicy.MUST_SAVE
    assert _sac_policy(None, torch.ops.aten.mul.Tensor) is CheckpointPolicy.PREFER_RECOMPUTE

    one_layer = dataclasses.replace(TINY_LLAMA, llama=dataclasses.replace(TINY_LLAMA.llama, layers=1))

    def saved(method: str) -> int:
        torch._dynamo.reset()
        setup = one_layer.build()
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
