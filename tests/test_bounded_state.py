"""Bounded state: compiling and dropping models leaves nothing of fxmem's behind (issue 46, item 4).

A region keeps records, not graphs; its calibration slots and fidelity probes are released once its compiled code
is freed, and not before; the default backend forgets the regions of dropped code. RSS is measured by
benchmarks/compile_cycles.py: torch.compile itself grows a few MiB per cycle, too noisy to assert fxmem's share on.
"""

import collections
import gc
import importlib
import weakref

import torch
from torch.fx.graph_module import _loader as fx_source_loader

import fxmem
from fxmem.kernels import calibration, probe
from tests.conftest import tiny_model

backend_module = importlib.import_module("fxmem.backend")
pipeline = importlib.import_module("fxmem.pipeline")


def _partitioned_graphs(monkeypatch) -> list[weakref.ref]:
    """Weak references to every graph the partitioner splits and returns (joint, forward, backward): the modules and
    their graphs (a node holds its graph, not its module)."""
    refs = []
    partition = pipeline.min_cut_rematerialization_partition

    def recording(joint, joint_inputs, **kwargs):
        fw, bw = partition(joint, joint_inputs, **kwargs)
        refs.extend(weakref.ref(graph) for gm in (joint, fw, bw) for graph in (gm, gm.graph))
        return fw, bw

    monkeypatch.setattr(pipeline, "min_cut_rematerialization_partition", recording)
    return refs


def _fxmem_objects() -> collections.Counter:
    gc.collect()
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects()
                               if str(getattr(type(o), "__module__", "")).startswith("fxmem."))


def _drop():
    torch._dynamo.reset()  # frees the compiled code (dropping the model alone leaves it in dynamo's cache)
    gc.collect()


def test_compiling_and_dropping_models_with_the_default_backend_leaves_nothing_behind(monkeypatch):
    graphs = _partitioned_graphs(monkeypatch)
    options = {"preset": "hyclora-4bit", "calibration": "static", "calibration_steps": 2}
    slots_before, regions, counts, sources = dict(calibration.SLOTS), [], [], []
    for _ in range(3):
        model, batch = tiny_model("llama", lora=True, layers=1)
        compiled = torch.compile(model, backend="fxmem", options=options)
        compiled(**batch).loss.backward()
        region = backend_module._DEFAULT.regions[-1]
        regions.append(weakref.ref(region))
        gc.collect()  # the live code keeps its slots: the second step finds them, and freezes them
        compiled(**batch).loss.backward()
        assert region.slots and all(calibration.SLOTS[s.id] is s and s.calibrated for s in region.slots)
        del model, batch, compiled, region
        _drop()
        counts.append(_fxmem_objects())
        sources.append(len(fx_source_loader.eval_cache))
    assert backend_module._DEFAULT.regions == []
    assert graphs and not [ref for ref in graphs if ref() is not None]  # no graph outlives its compile
    assert not [ref for ref in regions if ref() is not None]
    assert calibration.SLOTS == slots_before
    assert counts[-1] - counts[0] == collections.Counter()  # nothing of fxmem's grows from one cycle to the next
    # torch.fx keeps the source of every graph it compiled; fxmem's passes make some twenty a region, and forget
    # them with the code. Left: dynamo's graph, its copy, and the backward AOTAutograd recompiles, as torch.compile's
    assert sources[2] - sources[1] <= 3, sources


def test_a_backend_keeps_the_report_of_dropped_code_and_releases_its_runtime_state(monkeypatch):
    graphs = _partitioned_graphs(monkeypatch)
    config = fxmem.Config.from_preset("hyclora-4bit", calibration="static")
    backend = fxmem.Backend(config, lowering="eager", fidelity_probes=True)
    model, batch = tiny_model("llama", lora=True, layers=1)
    compiled = torch.compile(model, backend=backend)
    compiled(**batch).loss.backward()
    [region] = backend.regions
    report = backend.report().to_json()
    assert region.slots and all(calibration.SLOTS[s.id] is s for s in region.slots)
    assert region.probes and all(p in probe.COMPRESSED for p, _ in region.probes)
    del model, batch, compiled
    _drop()
    assert backend.regions == [region] and backend.report().to_json() == report  # records: all the report needs
    assert f"{len(region.slots)} quantized storages" in backend.report().table(width=300)
    assert not [s for s in region.slots if s.id in calibration.SLOTS]
    assert not [p for p, _ in region.probes if p in probe.COMPRESSED]
    assert graphs and not [ref for ref in graphs if ref() is not None]
