"""The typed plans (fxmem/cost_model/plan.py): one class per action, each with only the fields its rewrite reads."""

import dataclasses

import pytest
import torch
from torch.fx import Graph

from fxmem.cost_model.plan import (
    Action,
    Checkpoint,
    Keep,
    LowRank,
    Quantize,
    RebuildNormInput,
    Recompute,
    Sparsify,
)


def test_each_action_has_its_own_class_and_value():
    plans = [Keep("k"), Recompute("r"), Quantize("q", bits=4, channels=8), Sparsify("s", kept_per_row=2),
             LowRank("l", rank=4), RebuildNormInput("p", bits=8), Checkpoint("c", block="model.layers.0")]
    assert [p.action for p in plans] == list(Action)
    assert [p.to_dict()["action"] for p in plans] == [a.value for a in Action]  # golden plans and reports write it


def test_a_plan_refuses_a_field_of_another_action():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bits'"):
        Keep("k", bits=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'host'"):
        dataclasses.replace(Recompute("r"), host=True)  # only what stores something waits in host memory
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'rank'"):
        LowRank("l")
    assert not hasattr(Keep("k"), "keep") and Sparsify("s", kept_per_row=2).kept_per_row == 2
    assert not Recompute("r").host and dataclasses.replace(Keep("k"), host=True).host


def test_to_dict_writes_what_is_set_and_no_graph_reference():
    graph = Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.relu, (x,))
    plan = Recompute("rebuilt element-wise", nbytes=0, chain=(relu,))
    assert plan.to_dict() == {"action": "recompute", "reason": "rebuilt element-wise"}
    assert plan.record().chain == () and plan.record() == plan  # graph references are not compared
    assert Quantize("q", bits=2, channels=64, outliers=1, nbytes=10).to_dict() == {
        "action": "quantize", "reason": "q", "bits": 2, "channels": 64, "outliers": 1, "nbytes": 10}
    assert Checkpoint("c", block="model.layers.1", price="a 1 ms forward for 2 MiB").to_dict() == {
        "action": "checkpoint", "reason": "c", "block": "model.layers.1", "price": "a 1 ms forward for 2 MiB"}


def test_plan_itself_is_abstract():
    from fxmem.cost_model.plan import Plan
    with pytest.raises(TypeError, match="Plan is abstract: make one of its subclasses .Keep, Recompute"):
        Plan("no action")
