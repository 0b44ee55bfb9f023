"""fxmem/pipeline.py runs torch's min-cut at most twice per region for a preset, and three times under a
memory_budget fraction: each run is one the region's plan needs."""

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

import fxmem
from fxmem import pipeline
from fxmem.cost_model.plan import Action
from fxmem.analysis.meta import RECOMPUTE
from fxmem.cost_model.plan import Recompute
from fxmem.passes.manager import copy_graph_module
from tests.conftest import pass_summary, tiny_model


@pytest.fixture
def min_cuts(monkeypatch):
    """The graphs min-cut partitions, in order: each a list of the node names it was tagged to recompute."""
    real, runs = pipeline.min_cut_rematerialization_partition, []

    def counted(joint, *args, **kwargs):
        runs.append(sorted(n.name for n in joint.graph.nodes if n.meta.get("recompute") is not None
                           and "must_recompute" in str(n.meta["recompute"]).lower()))
        return real(joint, *args, **kwargs)

    monkeypatch.setattr(pipeline, "min_cut_rematerialization_partition", counted)
    return runs


def _compile(config):
    torch._dynamo.reset()
    model, batch = tiny_model("llama", lora=True)
    backend = fxmem.Backend(config, lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    [region] = backend.report().regions
    return backend, region


def test_a_preset_partitions_once_and_once_more_with_its_recomputations_tagged(min_cuts):
    _, region = _compile(fxmem.Config.from_preset("hyclora-4bit"))
    assert any(p.action is Action.RECOMPUTE for p in region.plans)
    assert len(min_cuts) == 2
    assert set(min_cuts[1]) > set(min_cuts[0])  # the joint passes' tags, and the plan's chains


def test_a_budget_partitions_torchs_way_then_twice_and_carries_the_first_plans_recomputations(min_cuts, monkeypatch):
    carried = []
    real = pipeline.Partitioner._tag_carried

    def tag_carried(joint, recomputed):
        tagged = real(joint, recomputed)
        carried.append(None if tagged is None else {n.name for _, plan in tagged for n in plan.chain})
        return tagged

    monkeypatch.setattr(pipeline.Partitioner, "_tag_carried", staticmethod(tag_carried))
    backend, region = _compile(fxmem.Config(memory_budget=0.05))
    # the first plan compressed q, k and v: the region was partitioned again, attention recomputed in those layers
    assert pass_summary(backend, "recompute_attention").startswith("2 ")
    assert len(min_cuts) == 3
    exact, first, second = min_cuts
    [chains] = carried
    assert chains and not chains & set(first)  # the first plan's chains, not tagged by any joint pass
    assert not exact  # torch's own partition, the fraction's reference: no fxmem pass ran on it


def _carried_chain():
    """A traced graph, a copy of it (the second partition's joint), and a recomputation planned on the first."""
    traced = torch.fx.symbolic_trace(lambda x: (x.sin() * 2).cos())
    chain = [n for n in traced.graph.nodes if n.op == "call_method" and n.target == "sin"]
    return copy_graph_module(traced), [(None, Recompute("planned on the first partition", chain=chain))]


def test_carried_chains_are_tagged_on_the_second_joint_by_name():
    joint, carried = _carried_chain()
    assert pipeline.Partitioner._tag_carried(joint, carried) is carried
    tagged = [n.name for n in joint.graph.nodes if n.meta.get(RECOMPUTE) is CheckpointPolicy.MUST_RECOMPUTE]
    assert tagged == ["sin"]


def test_a_chain_missing_from_the_second_joint_or_through_what_it_must_save_is_not_carried():
    joint, carried = _carried_chain()
    [sin] = [n for n in joint.graph.nodes if n.name == "sin"]
    sin.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE  # checkpoint_blocks' block input: its tag stands
    assert pipeline.Partitioner._tag_carried(joint, carried) is None
    assert sin.meta[RECOMPUTE] is CheckpointPolicy.MUST_SAVE
    del sin.meta[RECOMPUTE]
    sin.name = "sin_renamed"
    assert pipeline.Partitioner._tag_carried(joint, carried) is None
    assert all(RECOMPUTE not in n.meta for n in joint.graph.nodes)
