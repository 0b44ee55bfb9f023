import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

import fxmem
from fxmem.analysis import Role
from fxmem.measure import model_tensors, peak_memory, saved_activation_bytes
from tests.conftest import loss_and_grads, tiny_model

# fxmem.backend is the public function; the module of the same name is reached through importlib.
backend_module = importlib.import_module("fxmem.backend")


def assert_same(reference, candidate, rtol=1e-5, atol=1e-7):
    ref_loss, ref_grads = reference
    loss, grads = candidate
    torch.testing.assert_close(loss, ref_loss, rtol=rtol, atol=atol)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("family", ["llama", "bert", "gpt2"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_exact_matches_torch_compile(family, lora):
    # one block: a second repeats the first's ops (inductor's compile time grows with the graph)
    model, batch = tiny_model(family, lora=lora, layers=1)
    reference = loss_and_grads(torch.compile(model), model, batch)
    torch._dynamo.reset()
    backend = fxmem.backend()
    result = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert_same(reference, result)
    [region] = backend.regions
    assert region.kind == "training" and region.notes == []
    assert all(s.role is not Role.UNKNOWN for s in region.saved), [s for s in region.saved
                                                                   if s.role is Role.UNKNOWN]


def test_entry_point_works_without_importing_fxmem():
    script = textwrap.dedent("""
        import sys, torch
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
        x = torch.randn(4, 8)
        expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        got = torch.autograd.grad(torch.compile(model, backend="fxmem")(x).sum(), list(model.parameters()))
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(expected, got))
        print("fxmem" in sys.modules, "fxmem" in torch._dynamo.list_backends())
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True"]


def test_options_choose_the_config_per_compile():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="fxmem", options={"preset": "exact", "calibration_steps": 3})
    compiled(x).sum().backward()
    region = backend_module._DEFAULT.regions[-1]
    assert region.config == fxmem.Config(calibration_steps=3)


def test_inductor_options_go_to_inductor(monkeypatch):
    patches = []

    def recording_compile_fx(gm, example_inputs, **kwargs):
        patches.append(kwargs["config_patches"])
        return compile_fx(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend_module, "compile_fx", recording_compile_fx)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    compiled = torch.compile(model, backend="fxmem",
                             options={"preset": "exact", "triton.cudagraphs": False, "max_autotune": False})
    compiled(torch.randn(4, 8)).sum().backward()
    assert patches[-1]["triton.cudagraphs"] is False and patches[-1]["max_autotune"] is False
    assert backend_module._DEFAULT.regions[-1].config == fxmem.Config()
    assert patches[-1]["reorder_for_peak_memory"] is False  # fxmem's default (backend.LOWERING_PATCHES)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxmem", options={"reorder_for_peak_memory": True})
    compiled(torch.randn(4, 8)).sum().backward()
    assert patches[-1]["reorder_for_peak_memory"] is True  # the user's own inductor option wins


# What LOWERING_PATCHES changes, each against inductor's default, on a 2-layer tiny Llama at 1,024 tokens under
# hyclora-4bit. On llama-small at 2,048 tokens each default raised the step peak (measured: docs/long-context.md).
@pytest.mark.parametrize("option, inductor_default", [("reorder_for_peak_memory", True),
                                                      ("score_fusion_memory_threshold", 10)])
def test_each_lowering_patch_lowers_a_long_steps_peak(option, inductor_default):
    model, _ = tiny_model("llama", lora=True)
    ids = torch.randint(0, 256, (1, 1024), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def step_peak(options):
        torch._dynamo.reset()
        config = fxmem.Config.from_preset("hyclora-4bit", return_logits=False)
        forward = torch.compile(model, backend=fxmem.Backend(config), options=options)
        forward(**batch).loss.backward()  # compiled, with its gradients' storage
        return peak_memory(lambda: forward(**batch).loss.backward(), "cpu")

    assert step_peak({}) < step_peak({option: inductor_default})


class TwoRegions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)

    def forward(self, x):
        hidden = torch.nn.functional.silu(self.first(x))
        torch._dynamo.graph_break()
        return torch.tanh(self.second(hidden)).square().mean()


def test_a_graph_break_gives_two_regions_each_reported():
    torch.manual_seed(0)
    model, x = TwoRegions(), torch.randn(8, 16)
    expected = torch.autograd.grad(model(x), list(model.parameters()))
    backend = fxmem.backend()
    got = torch.autograd.grad(torch.compile(model, backend=backend)(x), list(model.parameters()))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [r.kind for r in backend.regions] == ["training", "training"]
    roles = [{s.role for s in r.saved if s.frees_memory} for r in backend.regions]
    assert Role.ACT_INPUT in roles[0] and Role.ACT_INPUT in roles[1]
    assert backend.report().activation_bytes == sum(s.nbytes for r in backend.regions for s in r.saved) > 0


def test_varying_sequence_length_compiles_at_most_twice():
    model, _ = tiny_model("llama", lora=True, layers=1)
    backend = fxmem.backend()
    compiled = torch.compile(model, backend=backend)
    for length in (8, 12, 20, 28):
        ids = torch.randint(0, 256, (2, length))
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.testing.assert_close(loss, model(input_ids=ids, labels=ids).loss, rtol=1e-4, atol=1e-5)
    assert len(backend.regions) <= 2
    assert all(r.kind == "training" and r.notes == [] for r in backend.regions)
    dynamic = backend.regions[-1]
    assert any("s" in s.shape_text for s in dynamic.saved), "the last region should be shape-polymorphic"


def test_inference_goes_through_untouched():
    model, batch = tiny_model("llama", lora=True)
    model.eval()
    with torch.no_grad():
        expected = torch.compile(model)(input_ids=batch["input_ids"]).logits
        torch._dynamo.reset()
        backend = fxmem.backend()
        got = torch.compile(model, backend=backend)(input_ids=batch["input_ids"]).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert [r.kind for r in backend.regions] == ["inference"]
    assert backend.regions[0].saved == []


class Unusual(torch.nn.Module):
    """Ops no rule knows (cumsum, sort, flip, a custom autograd.Function)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(12, 12))

    def forward(self, x):
        y = torch.cumsum(x @ self.weight, dim=-1)
        y = torch.sort(y, dim=-1).values.flip(-1)
        return _Cube.apply(y).logsumexp(-1).mean()


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x * x * grad


def test_an_unrecognised_graph_compiles_as_inductor_does():
    torch.manual_seed(0)
    model, x = Unusual(), torch.randn(6, 12, requires_grad=True)
    expected_bytes, loss = saved_activation_bytes(lambda: torch.compile(model)(x), model_tensors(model) + [x])
    expected = torch.autograd.grad(loss, [model.weight, x])
    torch._dynamo.reset()
    backend = fxmem.backend()
    got_bytes, loss = saved_activation_bytes(lambda: torch.compile(model, backend=backend)(x),
                                             model_tensors(model) + [x])
    got = torch.autograd.grad(loss, [model.weight, x])
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got_bytes == expected_bytes == backend.report().activation_bytes


@pytest.mark.parametrize("overrides", [{}, {"memory_budget": 0.5}])  # a budget analyzes torch's own partition first
def test_an_analysis_failure_falls_back_to_inductor_and_says_so(monkeypatch, overrides, lenient):
    def broken(*args, **kwargs):
        raise RuntimeError("synthetic analysis bug")

    monkeypatch.setattr(importlib.import_module("fxmem.pipeline"), "analyze", broken)
    model, batch = tiny_model("llama", lora=True, layers=1)
    reference = loss_and_grads(torch.compile(model), model, batch)
    torch._dynamo.reset()
    backend = fxmem.backend(**overrides)
    with pytest.warns(fxmem.FallbackWarning, match="synthetic analysis bug"):
        result = loss_and_grads(torch.compile(model, backend=backend), model, batch)
    assert_same(reference, result)
    assert "compiles as plain inductor" in backend.regions[0].notes[0]
    assert "synthetic analysis bug" in backend.report().table()


def test_the_partitioner_pickles_to_its_cache_identity_and_copies_to_itself():
    import copy
    import pickle

    from fxmem.pipeline import Partitioner
    from fxmem.region import Region
    partitioner = Partitioner(Region(index=0, config=fxmem.Config(bits=4)), None)
    assert copy.deepcopy(partitioner) is partitioner
    assert pickle.loads(pickle.dumps(partitioner)) == partitioner.uuid()
    assert "bits=4" in partitioner.uuid()
