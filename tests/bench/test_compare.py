import pytest

from fxmem import Config
from fxmem.bench.compare import budget_matching, planned_bytes, run_workload
from tests.conftest import TINY_LLAMA


def test_budget_search_finds_a_budget_below_one_for_a_smaller_target():
    full = planned_bytes(TINY_LLAMA, Config(), "cpu", 16)
    budget = budget_matching(TINY_LLAMA, full // 2, "cpu", 16, iterations=4)
    assert 0.0 <= budget < 1.0
    assert planned_bytes(TINY_LLAMA, Config(), "cpu", 16, budget=budget) <= full // 2


def test_run_workload_rejects_unknown_methods():
    with pytest.raises(ValueError, match="unknown method.*valid methods: eager, compile"):
        run_workload(TINY_LLAMA, methods=["eager", "deepspeed"])
