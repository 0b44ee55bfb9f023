import copy
import dataclasses
import sys
import warnings

import pytest
import torch

from fxmem import Backend, Config, FallbackError, FallbackWarning
from fxmem.cost_model.plan import Action
from fxmem.passes import GqaAttention, GraphPass, PassManager, PassRecord, PassResult, PipelineState
from fxmem.region import Region


class CountSavedTensors(GraphPass):
    """Reads the analysis, rewrites nothing."""
    name, stage = "count-saved", "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        return PassResult(False, f"{len(state.analysis.saved)} saved")


class NegateTwice(GraphPass):
    """A real joint rewrite that keeps the math: x -> neg(neg(x)) on the first matmul's output."""
    name, stage = "negate-twice", "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        mm = next(n for n in graph.nodes if n.target is torch.ops.aten.mm.default)
        with graph.inserting_after(mm):
            first = graph.call_function(torch.ops.aten.neg.default, (mm,))
        with graph.inserting_after(first):
            second = graph.call_function(torch.ops.aten.neg.default, (first,))
        mm.replace_all_uses_with(second, delete_user_cb=lambda user: user is not first)
        for node in (first, second):
            node.meta = dict(mm.meta)
        return PassResult(True, "inserted 2 nodes")


class Breaks(GraphPass):
    name, stage = "breaks", "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        graph.erase_node(next(n for n in graph.nodes if n.op == "output"))  # leaves a broken graph behind
        raise RuntimeError("synthetic pass bug")


class BreaksDynamo(GraphPass):
    name, stage = "breaks-dynamo", "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.dynamo.graph
        graph.erase_node(next(n for n in graph.nodes if n.op == "output"))
        raise RuntimeError("synthetic dynamo-stage bug")


class NeverEnabled(GraphPass):
    name, stage = "never", "joint"

    def enabled(self, config: Config) -> bool:
        return False

    def run(self, state: PipelineState) -> PassResult:
        raise AssertionError("a disabled pass must not run")


def _model_and_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    expected = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    return model, x, expected


def _run(backend, model, x, expected):
    got = torch.autograd.grad(torch.compile(model, backend=backend)(x).square().mean(), list(model.parameters()))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_passes_run_in_order_and_are_recorded():
    model, x, expected = _model_and_reference()
    backend = Backend(passes=PassManager([NeverEnabled(), NegateTwice(), CountSavedTensors()]))
    _run(backend, model, x, expected)
    records = backend.regions[0].passes
    assert [(r.name, r.stage, r.error) for r in records] == [("negate-twice", "joint", None),
                                                              ("count-saved", "partitioned", None)]
    assert records[0].note == "inserted 2 nodes" and records[0].changed
    assert records[1].note == f"{len(backend.regions[0].saved)} saved" and not records[1].changed
    assert "pass negate-twice (joint): inserted 2 nodes" in backend.report().table()


def test_a_failing_pass_rolls_its_stage_back_and_is_reported(lenient):
    model, x, expected = _model_and_reference()
    backend = Backend(passes=PassManager([NegateTwice(), Breaks(), CountSavedTensors()]))
    _run(backend, model, x, expected)  # compiles and is correct despite the broken pass
    records = {r.name: r for r in backend.regions[0].passes}
    assert records["breaks"].error == "RuntimeError: synthetic pass bug"
    assert records["negate-twice"].note == "inserted 2 nodes"  # ran, then rolled back with its stage
    assert not records["negate-twice"].changed
    assert records["count-saved"].error is None  # the next stage still runs
    assert "synthetic pass bug" in backend.report().table()


def test_a_failing_dynamo_pass_leaves_dynamos_graph_to_compile_as_captured(lenient):
    model, x, expected = _model_and_reference()
    backend = Backend(passes=PassManager([BreaksDynamo(), CountSavedTensors()]))
    _run(backend, model, x, expected)
    records = {r.name: r for r in backend.regions[0].passes}
    assert records["breaks-dynamo"].error == "RuntimeError: synthetic dynamo-stage bug"
    assert records["count-saved"].error is None


def test_a_pass_with_an_unknown_stage_is_refused():
    class Wrong(GraphPass):
        name, stage = "wrong", "lowering"

        def run(self, state):
            return PassResult(False)

    with pytest.raises(ValueError, match="pass 'wrong' has stage 'lowering'; valid stages: dynamo, joint, partitioned"):
        PassManager([Wrong()])


class BreaksAfterQuantizing(GraphPass):
    name, stage = "breaks-late", "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        raise RuntimeError("synthetic late bug")


def test_a_rollback_also_undoes_the_plans_and_quantization_state_of_its_stage(lenient):
    from fxmem.kernels import calibration
    from fxmem.passes import QuantizeSaved
    model, x, expected = _model_and_reference()
    before = dict(calibration.SLOTS)
    backend = Backend(Config(bits=4, calibration="static"),
                      passes=PassManager([QuantizeSaved(), BreaksAfterQuantizing()]))
    _run(backend, model, x, expected)  # exact: the quantization was rolled back with its stage
    region = backend.regions[0]
    assert region.passes[0].note == "2 storage(s) quantized" and region.passes[1].error  # SiLU and 2nd linear input
    assert region.slots == [] and calibration.SLOTS == before  # its calibration slots released
    assert all(p.action is Action.KEEP for p in region.plans)
    assert "pass breaks-late failed: rolled back" in {p.reason for p in region.plans}
    # what was planned stays on record beside what was applied
    assert [planned.action for _, planned, _ in region.undone()] == [Action.QUANTIZE] * 2
    assert backend.report().planned_bytes == backend.report().activation_bytes


def test_a_rollback_releases_the_fidelity_probes_its_stage_registered(lenient):
    from fxmem.kernels import probe
    from fxmem.passes import QuantizeSaved
    model, x, expected = _model_and_reference()
    before = dict(probe.COMPRESSED)
    backend = Backend(Config(bits=4), passes=PassManager([QuantizeSaved(), BreaksAfterQuantizing()]),
                      fidelity_probes=True)
    _run(backend, model, x, expected)
    assert backend.regions[0].passes[0].note == "2 storage(s) quantized"  # probed, then rolled back
    assert backend.regions[0].probes == [] and probe.COMPRESSED == before


class Unlowerable(GraphPass):
    """A correct rewrite inductor cannot lower: new_zeros is decomposed away before lowering."""
    name, stage = "unlowerable", "partitioned"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.bw.graph
        output = graph.find_nodes(op="output")[0]
        grad = next(a for a in output.args[0] if isinstance(a, torch.fx.Node))
        with graph.inserting_before(output):
            zeros = graph.call_function(torch.ops.aten.new_zeros.default, (grad, list(grad.meta["val"].shape)))
            total = graph.call_function(torch.ops.aten.add.Tensor, (grad, zeros))
        zeros.meta["val"] = total.meta["val"] = grad.meta["val"]
        output.args = (tuple(total if a is grad else a for a in output.args[0]),)
        return PassResult(True, "added zeros inductor cannot lower")


def test_a_rewrite_inductor_cannot_lower_runs_as_aten_ops_with_a_note(lenient):
    model, x, expected = _model_and_reference()
    backend = Backend(passes=PassManager([Unlowerable()]))
    with pytest.warns(FallbackWarning, match="it runs as aten ops, unfused"):
        _run(backend, model, x, expected)  # still correct
    region = backend.regions[0]
    assert any("inductor could not lower a rewritten graph (InductorError" in note for note in region.notes)


class ReturnsText(GraphPass):
    """A pass written to the old contract: its summary as a string."""
    name, stage = "returns-text", "joint"

    def run(self, state: PipelineState) -> str:
        return "did something"


def test_a_pass_that_returns_no_pass_result_is_rolled_back_naming_it(lenient):
    model, x, expected = _model_and_reference()
    backend = Backend(passes=PassManager([NegateTwice(), ReturnsText()]))
    with pytest.warns(FallbackWarning, match="returns-text"):
        _run(backend, model, x, expected)
    records = {r.name: r for r in backend.regions[0].passes}
    assert records["returns-text"].error == "TypeError: pass returns-text returned str, not a PassResult"
    assert not records["negate-twice"].changed  # rolled back with its stage


def test_an_inductor_error_on_a_graph_fxmem_left_untouched_is_torchs_own(monkeypatch):
    # gqa_attention runs under every preset: with nothing to rewrite it notes why, and changes nothing
    model, x, _ = _model_and_reference()
    backend = Backend(passes=PassManager([GqaAttention(), CountSavedTensors()]))

    def inductor_fails(*args, **kwargs):
        raise RuntimeError("inductor's own failure")

    monkeypatch.setattr(sys.modules["fxmem.backend"], "compile_fx_inner", inductor_fails)
    with pytest.raises(Exception, match="inductor's own failure"):
        torch.compile(model, backend=backend)(x).square().mean().backward()
    records = backend.regions[0].passes
    assert [(r.name, r.changed) for r in records] == [("gqa_attention", False), ("count-saved", False)]
    assert records[0].note == "no attention with repeated key and value heads (and no mask)"
    assert not any("runs as aten ops" in note for note in backend.regions[0].notes)  # torch's error stands


def _fallback_error(error: BaseException) -> FallbackError | None:
    """The FallbackError an error is or was raised from (dynamo wraps a backend's errors)."""
    while error is not None and not isinstance(error, FallbackError):
        error = error.__cause__ or error.__context__
    return error


def test_a_rolled_back_pass_warns_once_naming_the_pass_its_stage_and_its_error(lenient):
    model, x, expected = _model_and_reference()
    backend = Backend(passes=PassManager([Breaks(), BreaksAfterQuantizing()]))
    with pytest.warns(FallbackWarning) as warned:
        _run(backend, model, x, expected)
    messages = [str(w.message) for w in warned if issubclass(w.category, FallbackWarning)]
    assert messages == [
        "fxmem region 0: pass breaks failed and its joint stage was rolled back, so none of that stage's rewrites "
        "apply here (RuntimeError: synthetic pass bug)",
        "fxmem region 0: pass breaks-late failed and its partitioned stage was rolled back, so none of that stage's "
        "rewrites apply here (RuntimeError: synthetic late bug)"]


def test_a_pass_that_fails_again_in_the_same_region_does_not_warn_again(lenient):
    # memory_budget partitions a region twice or three times: each run of the joint stage records its failures
    region = Region(index=3, config=Config())
    failed = PassRecord("breaks", "joint", PassResult(False), 0.0, error="RuntimeError: synthetic pass bug")
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        region.add_passes([failed])
        quantized = PassRecord("quantize", "partitioned", PassResult(True, "2 storage(s) quantized"), 0.0)
        region.add_passes([failed, quantized])
        region.add_passes([dataclasses.replace(failed, stage="partitioned", name="breaks-late")])
    assert [(w.category, str(w.message).split(" failed")[0]) for w in warned] == [
        (FallbackWarning, "fxmem region 3: pass breaks"), (FallbackWarning, "fxmem region 3: pass breaks-late")]
    assert [r.name for r in region.passes] == ["breaks", "breaks", "quantize", "breaks-late"]


@pytest.mark.parametrize("config, environment", [(Config(strict=True), "0"), (Config(), "1")])
def test_strict_mode_makes_a_rollback_an_error_naming_the_pass_and_the_reason(monkeypatch, config, environment):
    monkeypatch.setenv("FXMEM_STRICT", environment)
    model, x, _ = _model_and_reference()
    with pytest.raises(Exception) as raised:
        torch.compile(model, backend=Backend(config, passes=PassManager([Breaks()])))(x)
    error = _fallback_error(raised.value)
    assert str(error) == ("pass breaks (joint stage) failed: RuntimeError: synthetic pass bug [strict mode: "
                          "Config(strict=True) or FXMEM_STRICT=1 makes this an error]")
    assert isinstance(error.__context__, RuntimeError) and str(error.__context__) == "synthetic pass bug"


def test_strict_mode_makes_an_unlowerable_rewrite_an_error(monkeypatch):
    monkeypatch.setenv("FXMEM_STRICT", "1")
    model, x, _ = _model_and_reference()
    with pytest.raises(Exception) as raised:
        torch.compile(model, backend=Backend(passes=PassManager([Unlowerable()])))(x).sum().backward()
    assert "inductor could not lower a rewritten graph" in str(_fallback_error(raised.value))


def test_a_strict_setting_other_than_0_or_1_is_refused(monkeypatch):
    from fxmem.fallback import strict
    monkeypatch.setenv("FXMEM_STRICT", "yes")
    with pytest.raises(ValueError, match=r"FXMEM_STRICT must be one of 0, 1 \(or unset\); got 'yes'"):
        strict(Config())
    with pytest.raises(ValueError, match="strict must be True or False; got 'yes'"):
        Config(strict="yes")


def test_dead_code_elimination_keeps_in_place_calls_nothing_reads():
    # DeepSeek-V3's attention writes its rotary half in place (k[..., :r].copy_(...)), its group routing
    # scatter_s a mask: fx's own elimination dropped both once a dynamo-stage pass changed the graph (the causal
    # mask), and the model's loss changed.
    from fxmem.passes.manager import eliminate_dead_code

    def f(x):
        y = x.clone()
        y[:, :2].copy_(x[:, 2:4])
        y.scatter_(1, torch.zeros(2, 1, dtype=torch.long), 5.0)
        return y

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=capture)(torch.randn(2, 4))
    fx_only = copy.deepcopy(graphs[0])
    fx_only.graph.eliminate_dead_code()
    assert not [n for n in fx_only.graph.nodes if n.target in ("copy_", "scatter_")]  # what went wrong
    eliminate_dead_code(graphs[0].graph)
    graphs[0].recompile()
    assert [n.target for n in graphs[0].graph.nodes if n.op == "call_method"] == ["clone", "copy_", "scatter_"]
    x = torch.randn(2, 4)
    (out,) = graphs[0](x)
    torch.testing.assert_close(out, f(x))


@pytest.mark.parametrize("with_parent", [True, False])
def test_recomputing_an_output_of_a_split_recomputes_the_split(with_parent, tmp_path, monkeypatch):
    # DeepSeek-V3's latent attention splits q into its rotary and plain halves; rebuilding one half in backward
    # tagged the getitem alone, and torch's min-cut could neither save the split's tuple nor recompute it.
    import operator

    from functorch.compile import aot_function, min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    from fxmem.analysis.meta import RECOMPUTE
    from fxmem.passes.manager import tag_must_recompute

    def partition(joint, inputs, **kwargs):
        halves = [n for n in joint.graph.nodes if n.target is operator.getitem
                  and getattr(n.args[0], "target", None) is torch.ops.aten.split_with_sizes.default]
        if with_parent:
            tag_must_recompute(halves[:1])
        else:
            halves[0].meta[RECOMPUTE] = CheckpointPolicy.MUST_RECOMPUTE
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    def f(x):
        first, second = (x * 2).split([2, 2], dim=-1)
        return (first.sin() * second).sum()

    monkeypatch.chdir(tmp_path)  # torch dumps the graph it failed to partition there
    compiled = aot_function(f, fw_compiler=lambda gm, _: gm, partition_fn=partition)
    x = torch.randn(3, 4, requires_grad=True)
    if not with_parent:
        with pytest.raises(RuntimeError, match="failed to partition"):
            compiled(x)
        return
    compiled(x).backward()
    expected = torch.func.grad(f)(x.detach())
    torch.testing.assert_close(x.grad, expected)
