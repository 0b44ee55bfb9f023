"""fuse_epilogue: rebuilt LoRA outputs and their SwiGLU / GELU replaced by one fused kernel call, same values."""

import dataclasses

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fxmem
from fxmem.kernels import lora_epilogue
from fxmem.kernels.quantize import QuantSpec, dequantize, quantize
from fxmem.passes import FuseEpilogue, PassManager
from fxmem.passes.partitioned.fuse_epilogue import fuse_graph
from fxmem.techniques import default_passes
from tests.conftest import loss_and_grads, randomize_lora_b, tiny_model

ROWS, CHANNELS, IN, RANK = 24, 40, 16, 4


def _lora(x, w, xa, b, scaling):
    return torch.mm(x, w.permute(1, 0)) + torch.mm(xa, b.permute(1, 0)) * scaling


def _swiglu(x, w_gate, xa_gate, b_gate, w_up, xa_up, b_up):
    return torch.nn.functional.silu(_lora(x, w_gate, xa_gate, b_gate, 2.0)) * _lora(x, w_up, xa_up, b_up, 0.5)


def _quick_gelu(x, w, xa, b):
    y = _lora(x, w, xa, b, 2.0)
    return y * torch.sigmoid(1.702 * y)  # looks like GELU, is not: must be left alone


def _gelu_tanh(x, w, xa, b):
    return torch.nn.functional.gelu(_lora(x, w, xa, b, 2.0), approximate="tanh")


def _inputs(count_lora, dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(ROWS, IN, generator=generator)
    factors = []
    for _ in range(count_lora):
        factors += [torch.randn(CHANNELS, IN, generator=generator) / 4, torch.randn(ROWS, RANK, generator=generator),
                    torch.randn(CHANNELS, RANK, generator=generator) / 4]
    return [t.to(dtype) for t in (x, *factors)]


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_swiglu_becomes_one_kernel_call_with_the_same_output(dtype):
    inputs = _inputs(2, dtype)
    gm = make_fx(_swiglu, tracing_mode="fake")(*inputs)
    found = fuse_graph(gm, backward=False, on_reference=True)
    gm.recompile()
    assert [(e.kind, e.fused) for e in found] == [("swiglu", True)]
    # Per lora sum its (x A) B product is written and read back: 2 x (rows x channels) per sum, two sums.
    assert found[0].traffic_saved == 2 * 2 * ROWS * CHANNELS * inputs[0].element_size()
    targets = _targets(gm)
    assert "fxmem.lora_swiglu_forward.default" in targets and "aten.silu.default" not in targets
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(gm(*inputs), _swiglu(*inputs), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_approximation_is_read_from_the_values_and_a_lookalike_is_left_alone(dtype):
    inputs = _inputs(1, dtype)
    gm = make_fx(_gelu_tanh, tracing_mode="fake")(*inputs)
    assert [e.kind for e in fuse_graph(gm, backward=False, on_reference=True)] == ["gelu"]
    gm.recompile()
    (call,) = [n for n in gm.graph.nodes if n.target is torch.ops.fxmem.lora_gelu_forward.default]
    assert call.args[-2:] == (2.0, "tanh")
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(gm(*inputs), _gelu_tanh(*inputs), rtol=tol, atol=tol)
    # x sigmoid(1.702 x) is within bf16 rounding of GELU on most inputs; the region is compared in float64.
    _assert_left_alone(_quick_gelu, inputs, backward=False)


def test_the_kernels_run_on_cuda_only_when_the_config_asks(monkeypatch):
    monkeypatch.setattr(lora_epilogue, "uses_triton", lambda val: True)  # as on a CUDA tensor
    for triton, fused in ((False, False), (True, True)):
        gm = make_fx(_swiglu, tracing_mode="fake")(*_inputs(2, torch.float32))
        found = fuse_graph(gm, backward=False, on_reference=False, triton=triton)
        assert [(e.kind, e.fused) for e in found] == [("swiglu", fused)]
        assert ("fxmem.lora_swiglu_forward.default" in _targets(gm)) is fused


def _assert_left_alone(fn, inputs, *, backward, tracing_mode="fake"):
    gm = make_fx(fn, tracing_mode=tracing_mode)(*inputs)
    before = _targets(gm)
    assert fuse_graph(gm, backward=backward, on_reference=True) == []
    assert _targets(gm) == before


def test_a_broadcasting_sum_and_symbolic_channels_are_left_alone():
    x, w, xa, b = _inputs(1, torch.float32)

    def broadcast(x, w, xa, b):  # (1, rows, o) + (rows, 1, o): the sum is (rows, rows, o), not the kernel's shape
        base = torch.mm(x, w.permute(1, 0)).view(1, ROWS, CHANNELS)
        lora = (torch.mm(xa, b.permute(1, 0)) * 2.0).view(ROWS, 1, CHANNELS)
        return torch.nn.functional.gelu(base + lora)

    _assert_left_alone(broadcast, [x, w, xa, b], backward=False)
    # Every size symbolic, channels included: the kernels' tiles and packing need the channels as a number (dynamo
    # makes a sequence length dynamic, never the hidden sizes). Left alone, and without raising.
    _assert_left_alone(_gelu_tanh, [x, w, xa, b], backward=False, tracing_mode="symbolic")


SPEC = QuantSpec(CHANNELS, 4)


def _gelu_backward_graph(also_return_y):
    """A backward that rebuilds y = deq(X W) + 2 (X A) B^T for GELU's derivative, traced; and what the quantize
    pass would have recorded for it: the restored X W and the saved parts it reads."""
    def backward(grad, packed, scale, zero, ids, channel_values, index, values, xa, b):
        y_w = dequantize((packed, scale, zero, ids, channel_values, index, values), SPEC, torch.float32)
        y = y_w + torch.mm(xa, b.permute(1, 0)) * 2.0
        grad_y = torch.ops.aten.gelu_backward(grad, y)
        return (grad_y, y) if also_return_y else (grad_y,)

    generator = torch.Generator().manual_seed(1)
    y_w = torch.randn(ROWS, CHANNELS, generator=generator)
    args = [torch.randn(ROWS, CHANNELS, generator=generator), *quantize(y_w, SPEC),
            torch.randn(ROWS, RANK, generator=generator), torch.randn(CHANNELS, RANK, generator=generator) / 4]
    gm = make_fx(backward, tracing_mode="fake")(*args)
    [add] = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor and n.args[0].op != "placeholder"
             and n.args[1].target is torch.ops.aten.mul.Tensor]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return gm, args, backward, {add.args[0]: (*placeholders[1:4], SPEC)}


def test_backward_gelu_rebuild_is_fused_unless_the_rebuilt_output_is_read_elsewhere():
    gm, args, backward, dequantized = _gelu_backward_graph(also_return_y=False)
    found = fuse_graph(gm, backward=True, on_reference=True, dequantized=dequantized)
    gm.recompile()
    assert [(e.kind, e.fused) for e in found] == [("gelu", True)]
    assert found[0].traffic_saved == 4 * ROWS * CHANNELS * 4  # the dequantized x W and the LoRA product
    targets = _targets(gm)
    assert "fxmem.lora_gelu_backward.default" in targets and "aten.bitwise_and.Scalar" not in targets
    torch.testing.assert_close(gm(*args), backward(*args), rtol=1e-5, atol=1e-5)
    # without the quantize pass's record, the same graph is not recognised as a quantized rebuild
    gm, args, _, _ = _gelu_backward_graph(also_return_y=False)
    assert fuse_graph(gm, backward=True, on_reference=True) == []

    # y itself is a graph output: the kernel would have to rebuild it once more, so nothing is fused.
    gm, args, _, dequantized = _gelu_backward_graph(also_return_y=True)
    before = _targets(gm)
    assert fuse_graph(gm, backward=True, on_reference=True, dequantized=dequantized) == []
    assert _targets(gm) == before


def _backend(config, on_reference):
    passes = default_passes()
    next(p for p in passes if isinstance(p, FuseEpilogue)).on_reference = on_reference
    return fxmem.Backend(config, lowering="eager", passes=PassManager(passes))


@pytest.mark.parametrize("family, overrides, kind", [
    ("llama", {}, "swiglu"),
    ("bert", {"bits": 8}, "gelu"),  # below 8 bits GELU is not rebuilt
])
def test_fused_training_step_gives_the_unfused_gradients(family, overrides, kind, monkeypatch):
    model, batch = tiny_model(family, lora=True)
    randomize_lora_b(model)
    # the kernels read X W's codes: rebuild_from_x would replay SwiGLU's X W instead
    config = fxmem.Config.from_preset("hyclora-2bit", rebuild_from_x=False, **overrides)
    unfused = _backend(config, on_reference=False)
    _, expected = loss_and_grads(torch.compile(model, backend=unfused), model, batch)
    summary = {p.name: p.note for p in unfused.regions[0].passes}["fuse_epilogue"]
    assert summary.startswith(f"2x {kind} (backward), 2x {kind} (forward) left to inductor (Config.fused_epilogue "
                              "is off: on an H200 inductor's code measured faster than the fused Triton kernels, "
                              "which would save ")
    torch._dynamo.reset()
    asked = _backend(dataclasses.replace(config, fused_epilogue=True), on_reference=False)
    loss_and_grads(torch.compile(model, backend=asked), model, batch)
    summary = {p.name: p.note for p in asked.regions[0].passes}["fuse_epilogue"]
    assert summary.startswith(f"2x {kind} (backward), 2x {kind} (forward) left to inductor: the fused kernels are "
                              "Triton (CUDA), where they would save ")
    traffic = summary.split("would save ")[1].split(" MiB")[0]
    torch._dynamo.reset()

    calls = []
    for side in ("forward", "backward"):
        reference = f"lora_{kind}_{side}_reference"
        original = getattr(lora_epilogue, reference)
        monkeypatch.setattr(lora_epilogue, reference,
                            lambda *a, side=side, original=original: calls.append(side) or original(*a))
    fused = _backend(config, on_reference=True)
    _, grads = loss_and_grads(torch.compile(model, backend=fused), model, batch)
    summary = {p.name: p.note for p in fused.regions[0].passes}["fuse_epilogue"]
    assert summary == (f"fused with the LoRA rebuild: 2x {kind} (backward), 2x {kind} (forward), {traffic} MiB less "
                       "memory traffic")
    assert sorted(calls) == ["backward"] * 2 + ["forward"] * 2  # one call per layer each way
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_dynamic_sequence_length_is_fused_without_specializing_it():
    model, _ = tiny_model("llama", lora=True, layers=1)
    randomize_lora_b(model)
    config = fxmem.Config.from_preset("hyclora-2bit", rebuild_from_x=False)
    batches = {seq: {"input_ids": ids, "labels": ids} for seq in (16, 24, 32)
               for ids in [torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seq))]}
    fused = _backend(config, on_reference=True)
    forward = torch.compile(model, backend=fused)
    grads = {seq: loss_and_grads(forward, model, batch)[1] for seq, batch in batches.items()}
    # the second length compiles a graph with a symbolic one and the third reuses it: a guard on the length
    # would have compiled a third
    assert len(fused.regions) == 2
    summary = {p.name: p.note for p in fused.regions[1].passes}["fuse_epilogue"]
    assert summary.startswith("fused with the LoRA rebuild: 1x swiglu (backward), 1x swiglu (forward)")
    torch._dynamo.reset()
    unfused = torch.compile(model, backend=_backend(config, on_reference=False), dynamic=False)
    for name, grad in loss_and_grads(unfused, model, batches[32])[1].items():
        torch.testing.assert_close(grads[32][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_bf16_model_with_fp32_adapters_is_rebuilt_and_fused():
    # PEFT's default on a half-precision model: fp32 adapters (autocast_adapter_dtype), x cast up for them, the sum
    # in fp32 and cast back to bf16 before the activation.
    model, batch = tiny_model("llama", lora=True, dtype=torch.bfloat16, layers=1)
    randomize_lora_b(model)
    _, eager = loss_and_grads(model, model, batch)
    config = fxmem.Config.from_preset("hyclora-2bit", rebuild_from_x=False)
    cosines, summaries = {}, {}
    for on_reference in (False, True):
        backend = _backend(config, on_reference)
        _, grads = loss_and_grads(torch.compile(model, backend=backend), model, batch)
        summaries[on_reference] = {p.name: p.note for p in backend.regions[0].passes}
        cosines[on_reference] = sorted(torch.nn.functional.cosine_similarity(
            grads[name].flatten(), grad.flatten(), dim=0).item() for name, grad in eager.items())
        torch._dynamo.reset()
    assert summaries[True]["lora_reorder"].startswith("5 LoRA output(s) rebuilt in backward from x W and x A")
    assert summaries[True]["fuse_epilogue"].startswith(
        "fused with the LoRA rebuild: 1x swiglu (backward), 1x swiglu (forward)")
    # The kernels add the LoRA term in fp32 and skip the sum's rounding to bf16: at 2 bits the gradients are as
    # far from eager's as the unfused graph's (measured: minimum cosine 0.907 both, median 0.987).
    for position in (0, len(eager) // 2):
        assert cosines[True][position] > cosines[False][position] - 0.003


def test_rotated_codes_are_not_the_kernels_input():
    """The kernels read codes as channels; rotated codes (Config.rotation) are mixtures of them."""
    gm, _, _, dequantized = _gelu_backward_graph(also_return_y=False)
    [(restored, (*parts, spec))] = dequantized.items()
    rotated = {restored: (*parts, dataclasses.replace(spec, rotation=8))}
    assert fuse_graph(gm, backward=True, on_reference=True, dequantized=rotated) == []
