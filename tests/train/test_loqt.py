"""LoQT: NF4 storage, the layer's function, merges and compensation, the schedule, state, and the fxmem backend."""

import io
import math

import pytest
import torch

from fxmem.kernels.nf4 import bitsandbytes, nf4_dequantize, nf4_nbytes, nf4_quantize
from fxmem.train import LoQT, LoQTConfig, LoQTLinear
from fxmem.train.loqt import FrozenMatrix, convert, loqt_layers, weight_nbytes
from tests.conftest import tiny_model


def _linear(in_features: int, out_features: int, *, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias)


def _layer(in_features: int, out_features: int, config: LoQTConfig, *, bias: bool = False, seed: int = 0
           ) -> LoQTLinear:
    """A LoQT layer after its first merge, on a seeded gradient, with a B as training would leave it."""
    layer = LoQTLinear.from_linear(_linear(in_features, out_features, bias=bias, seed=seed), config)
    generator = torch.Generator().manual_seed(seed + 1)
    layer.merge(layer.effective_weight(), torch.randn(out_features, in_features, generator=generator))
    with torch.no_grad():
        layer.b.copy_(torch.randn(layer.b.shape, generator=generator) * 0.05)
    return layer


def _tiny_loqt(config: LoQTConfig, seed: int = 0, layers: int = 2):
    model, batch = tiny_model("llama", lora=False, seed=seed, layers=layers)
    convert(model, config, lambda m: m(**batch).loss)
    return model, batch


def test_nf4_storage_is_four_bits_plus_double_quantized_block_scales():
    matrix = FrozenMatrix((1024, 1024), quantized=True, dtype=torch.float32)
    numel = 1024 * 1024
    blocks = numel // 64
    expected = numel // 2 + blocks + 4 * math.ceil(blocks / 256) + 4  # codes, 8-bit scales, their scales, offset
    assert matrix.nbytes == nf4_nbytes(numel) == expected == 540_932
    assert sum(b.numel() * b.element_size() for b in matrix.buffers()) == expected
    assert 8 * expected / numel == pytest.approx(4.127, abs=1e-3)
    # An odd size: the last block and the last byte are partial.
    assert nf4_nbytes(63) == 32 + 1 + 4 + 4


def test_nf4_round_trip_is_bitsandbytes_own_and_stored_in_place():
    weight = torch.randn(172, 64, generator=torch.Generator().manual_seed(0))
    functional = bitsandbytes().functional
    packed, state = functional.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    parts = nf4_quantize(weight)
    ours = nf4_dequantize(parts.packed, parts.absmax, parts.absmax_scale, parts.absmax_offset, weight.shape,
                          torch.float32)
    assert torch.equal(ours, functional.dequantize_4bit(packed, state))
    assert 0.05 < ((ours - weight).norm() / weight.norm()).item() < 0.12  # NF4's error on Gaussian weights
    matrix = FrozenMatrix((172, 64), quantized=True, dtype=torch.float32)
    packed_buffer = matrix.packed
    matrix.assign(weight)
    assert matrix.packed is packed_buffer and torch.equal(matrix.get(torch.float32), ours)


@pytest.mark.parametrize("in_features, out_features", [(64, 172), (172, 64)])
@pytest.mark.parametrize("quantize", [True, False])
def test_forward_is_dequantized_weight_plus_scaled_low_rank_update(in_features, out_features, quantize):
    config = LoQTConfig(rank=8, scale=0.7, quantize=quantize, quantize_projection=quantize)
    layer = _layer(in_features, out_features, config)
    x = torch.randn(3, 5, in_features, generator=torch.Generator().manual_seed(2))
    w, p, b = layer.weight.get(torch.float32), layer.projection.get(torch.float32), layer.b.detach()
    if in_features <= out_features:  # P on the input side, B spans the larger output side
        assert layer.side == "input" and p.shape == (8, in_features) and b.shape == (out_features, 8)
        expected = x @ w.T + 0.7 * (x @ p.T) @ b.T
    else:
        assert layer.side == "output" and p.shape == (out_features, 8) and b.shape == (8, in_features)
        expected = x @ w.T + 0.7 * (x @ b.T) @ p.T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.effective_weight(), w + 0.7 * layer.update_matrix(p, b), rtol=0, atol=0)


def test_only_b_trains_and_the_input_gradient_is_the_effective_weights():
    layer = _layer(64, 172, LoQTConfig(rank=8), bias=True)
    assert torch.equal(layer.bias, _linear(64, 172, bias=True).bias)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["b"]
    assert {n for n, _ in layer.named_buffers()} == {f"{m}.{t}" for m in ("weight", "projection")
                                                    for t in ("packed", "absmax", "absmax_scale", "absmax_offset")}
    x = torch.randn(4, 64, requires_grad=True)
    grad = torch.randn(4, 172)
    y = layer(x)
    torch.testing.assert_close(y, x @ layer.effective_weight().T + layer.bias, rtol=1e-5, atol=1e-5)
    y.backward(grad)
    torch.testing.assert_close(x.grad, grad @ layer.effective_weight(), rtol=1e-5, atol=1e-5)
    assert layer.b.grad is not None and layer.bias.grad is None


@pytest.mark.parametrize("in_features, out_features", [(64, 172), (172, 64)])
def test_merge_keeps_the_function_up_to_quantization_error_and_compensation_reduces_it(in_features, out_features):
    errors = {}
    for steps in (0, 5):
        layer = _layer(in_features, out_features, LoQTConfig(rank=8, compensation_steps=steps))
        before = layer.effective_weight()
        x = torch.randn(32, in_features, generator=torch.Generator().manual_seed(3))
        y_before = layer(x).detach()
        layer.merge(before, torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(4)))
        errors[steps] = ((layer.effective_weight() - before).norm() / before.norm()).item()
        output_error = ((layer(x).detach() - y_before).norm() / y_before.norm()).item()
        assert output_error < 0.12  # NF4's error, nothing more: the merged update is kept
        if steps == 0:
            assert torch.equal(layer.b, torch.zeros_like(layer.b))
    assert errors[0] < 0.1
    assert errors[5] < 0.9 * errors[0]  # measured: 0.077 vs 0.093


def test_nq_merge_is_exact_and_p_spans_the_gradients_top_singular_vectors():
    layer = _layer(64, 172, LoQTConfig(rank=8, quantize=False, quantize_projection=False))
    before = layer.effective_weight()
    gradient = torch.randn(172, 64, generator=torch.Generator().manual_seed(5))
    layer.merge(before, gradient)
    torch.testing.assert_close(layer.effective_weight(), before, rtol=0, atol=1e-6)
    assert torch.equal(layer.b, torch.zeros_like(layer.b))
    _, _, vh = torch.linalg.svd(gradient)
    p = layer.projection.get(torch.float32)
    torch.testing.assert_close(p.T @ p, vh[:8].T @ vh[:8], rtol=0, atol=1e-5)  # the same subspace


def test_schedule_is_the_papers_exponential_intervals_or_fixed_ones():
    assert LoQTConfig(rank=1).merge_steps(1000) == [100, 201, 302, 403, 505, 607, 709, 812, 916]
    assert LoQTConfig(rank=1, first_interval=10, schedule="fixed").merge_steps(45) == [10, 20, 30, 40]
    assert LoQTConfig(rank=1, first_interval=3, growth=2.0).merge_steps(40) == [3, 8, 15, 26]


def test_bad_config_names_the_valid_choices():
    with pytest.raises(ValueError, match="rank must be an integer >= 1; got 0"):
        LoQTConfig(rank=0)
    with pytest.raises(ValueError, match="schedule must be one of exponential, fixed; got 'linear'"):
        LoQTConfig(rank=4, schedule="linear")
    with pytest.raises(ValueError, match="growth must be a finite number >= 1; got 0.5"):
        LoQTConfig(rank=4, growth=0.5)
    with pytest.raises(ValueError, match="compensation_steps must be an integer >= 0; got -1"):
        LoQTConfig(rank=4, compensation_steps=-1)
    with pytest.raises(TypeError, match="quantize must be True or False; got 'nf4'"):
        LoQTConfig(rank=4, quantize="nf4")
    with pytest.raises(ValueError, match=r"target is not a valid regular expression: '\(q_proj'"):
        LoQTConfig(rank=4, target="(q_proj")
    model, batch = tiny_model("llama", lora=False)
    with pytest.raises(ValueError, match=r"no nn.Linear matches target '.\*c_attn'; the model's linears: "
                                         r"model.layers.0.self_attn.q_proj, .*, \.\.\.$"):
        convert(model, LoQTConfig(rank=4, target=".*c_attn"), lambda m: m(**batch).loss)
    with pytest.raises(ValueError, match=r"rank 100 exceeds model.layers.0.self_attn.q_proj's smaller dimension "
                                         r"\(64 x 64\)"):
        convert(model, LoQTConfig(rank=100), lambda m: m(**batch).loss)
    with pytest.raises(ValueError, match="the model has no LoQT layers; convert it first"):
        LoQT(model, LoQTConfig(rank=4), torch.optim.SGD(model.parameters(), lr=0.1), lambda m: m(**batch).loss)


def test_convert_targets_block_linears_and_keeps_an_unquantized_model_exactly():
    model, batch = tiny_model("llama", lora=False)
    with torch.no_grad():
        reference = model(**batch).logits
    convert(model, LoQTConfig(rank=4, quantize=False, quantize_projection=False), lambda m: m(**batch).loss)
    assert len(loqt_layers(model)) == 14 and isinstance(model.lm_head, torch.nn.Linear)  # 7 per block, not the head
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=1e-5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.embed_tokens.weight" in trainable and "model.layers.1.mlp.down_proj.b" in trainable


def test_merges_follow_optimizer_steps_not_micro_batches_and_reset_b_state():
    config = LoQTConfig(rank=4, first_interval=2, schedule="fixed")
    model, batch = _tiny_loqt(config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loqt = LoQT(model, config, optimizer, lambda m: m(**batch).loss)
    b = model.model.layers[0].mlp.up_proj.b
    merges = []
    for _ in range(5):
        for _ in range(3):  # gradient accumulation: three micro-batches per optimizer step
            model(**batch).loss.backward()
            merges.append(loqt.merges)
        optimizer.step()
        if loqt.optimizer_steps in (2, 4):
            assert b not in optimizer.state and b.grad is None  # B's moments described the old P
        else:
            assert b in optimizer.state
        optimizer.zero_grad()
    assert merges == [0] * 6 + [1] * 6 + [2] * 3
    assert loqt.state_dict() == {"optimizer_steps": 5, "merges": 2}


def test_a_merge_keeps_the_models_output_up_to_nf4_error():
    config = LoQTConfig(rank=4)
    model, batch = _tiny_loqt(config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loqt = LoQT(model, config, optimizer, lambda m: m(**batch).loss)
    for _ in range(3):  # B moves away from its compensation values
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    b = model.model.layers[0].mlp.up_proj.b
    b_before = b.detach().clone()
    with torch.no_grad():
        before = model(**batch).logits
    loqt.merge()
    with torch.no_grad():
        after = model(**batch).logits
    assert not torch.equal(b, b_before)
    assert ((after - before).norm() / before.norm()).item() < 0.02  # measured 0.003; dropping s P B: 0.28


def test_state_round_trip_continues_exactly():
    config = LoQTConfig(rank=4, first_interval=2, growth=2.0)  # merges after steps 2 and 6

    def run(model, batch, optimizer, loqt, steps):
        losses = []
        for _ in range(steps):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    def build(seed):
        model, batch = tiny_model("llama", lora=False)
        _, probe_batch = tiny_model("llama", lora=False, seed=seed)  # a different first gradient
        convert(model, config, lambda m: m(**probe_batch).loss)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, batch, optimizer, LoQT(model, config, optimizer, lambda m: m(**batch).loss)

    model, batch, optimizer, loqt = build(seed=0)
    run(model, batch, optimizer, loqt, 3)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "loqt": loqt.state_dict()}, saved)
    expected = run(model, batch, optimizer, loqt, 4)
    assert loqt.merges == 2

    fresh, fresh_batch, fresh_optimizer, fresh_loqt = build(seed=1)
    saved.seek(0)
    state = torch.load(saved)
    fresh.load_state_dict(state["model"])
    fresh_optimizer.load_state_dict(state["optimizer"])
    fresh_loqt.load_state_dict(state["loqt"])
    assert run(fresh, fresh_batch, fresh_optimizer, fresh_loqt, 4) == expected
    for (name, p), q in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_saved_weights_are_nf4_bytes():
    model, _ = _tiny_loqt(LoQTConfig(rank=4))
    layers = loqt_layers(model)
    state = model.state_dict()
    weight_bytes = sum(t.numel() * t.element_size() for k, t in state.items() if ".weight." in k and
                       k.rsplit(".weight.", 1)[0] in layers)
    numel = sum(layer.in_features * layer.out_features for layer in layers.values())
    assert weight_bytes == weight_nbytes(model)["weight"]
    assert 4.1 < 8 * weight_bytes / numel < 4.3


def test_fxmem_backend_compiles_loqt_with_eager_gradients_and_saves_only_what_b_needs():
    from fxmem import Backend
    config = LoQTConfig(rank=4, first_interval=1, schedule="fixed")
    model, batch = _tiny_loqt(config, layers=1)  # one block: each of its layers is checked by name below
    loss = model(**batch).loss
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    backend = Backend()
    compiled = torch.compile(model, backend=backend)
    compiled_loss = compiled(**batch).loss
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, eager[name], rtol=1e-4, atol=1e-6, msg=name)
    saved = [s for region in backend.regions for s in region.saved]
    # x P^T of every input-side layer is recognised as what B learns from (kept exact by every preset) ...
    intermediates = {s.module for s in saved if s.role.value == "lora_intermediate"}
    assert intermediates == {f"model.layers.0.{m}" for m in
                             ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                              "mlp.gate_proj", "mlp.up_proj")}
    # ... and no dequantized weight is held from forward to backward.
    assert not [s for s in saved if s.frees_memory and s.producer in ("nf4_linear", "dequantize_4bit")
                and s.role.value != "lora_intermediate"]

    # A merge rewrites the buffers in place: the compiled model computes the merged layers without recompiling.
    with torch.no_grad():
        compiled(**batch)
    regions = len(backend.regions)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
    loqt = LoQT(model, config, optimizer, lambda m: m(**batch).loss)
    optimizer.step()
    assert loqt.merges == 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch).logits, model(**batch).logits, rtol=1e-5, atol=1e-5)
    assert len(backend.regions) == regions
