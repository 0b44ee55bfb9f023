"""The harness's test fixtures: tiny workloads in place of the named ones."""

import pytest

from fxmem_bench.workloads import LlamaShape, Workload

TINY_LLAMA = Workload("test-llama", "llama", 2, 32, "tiny Llama for tests", LlamaShape(64, 172, 2, 4, 256))
# One decoder block: inductor's compile time grows with the graph, and a second block doubles it. For the tests of a
# command's plumbing (its tables, JSON and flags), where the number of blocks proves nothing; the tests that need two
# (block checkpointing, HiFT's layer groups, offloaded block inputs, FSDP2's per-block shards) keep TINY_LLAMA.
ONE_LAYER_LLAMA = Workload("test-llama-1", "llama", 2, 32, "one-block tiny Llama for tests",
                           LlamaShape(64, 172, 1, 4, 256))


@pytest.fixture
def tiny_workloads(monkeypatch):
    """Every workload name the CLI accepts runs the tiny Llama instead (the commands, not the sizes, are tested)."""
    from fxmem_bench import workloads
    monkeypatch.setattr(workloads, "get_workload", lambda name: TINY_LLAMA)


@pytest.fixture
def one_layer_workloads(monkeypatch):
    """As tiny_workloads, with the one-block tiny Llama (ONE_LAYER_LLAMA)."""
    from fxmem_bench import workloads
    monkeypatch.setattr(workloads, "get_workload", lambda name: ONE_LAYER_LLAMA)
