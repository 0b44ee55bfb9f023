import re

import pytest
import torch

from fxmem.fallback import FallbackWarning
from fxmem.kernels.linear_cross_entropy import HeadLora, linear_cross_entropy, linear_cross_entropy_reference
from fxmem.measure import peak_memory

TOKENS, HIDDEN, VOCAB, RANK = 37, 16, 50, 4


def _inputs(dtype, *, lora: bool, train_weight: bool = True, ignored_every: int = 5, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3).to(dtype).requires_grad_(train_weight)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    target[::ignored_every] = -100
    head_lora = None
    if lora:
        head_lora = HeadLora(torch.randn(RANK, HIDDEN, generator=generator).to(dtype).requires_grad_(),
                             torch.randn(VOCAB, RANK, generator=generator).to(dtype).requires_grad_(), 0.5)
    return x, weight, target, head_lora


def _loss_and_grads(loss_fn, x, weight, target, lora, **kwargs):
    trained = [t for t in (x, weight, *(lora[:2] if lora else ())) if t.requires_grad]
    loss = loss_fn(x, weight, target, lora=lora, **kwargs)
    return loss.detach(), torch.autograd.grad(loss * 1.7, trained)  # a loss scaled downstream, as by an optimizer


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 8, TOKENS, 1000])  # chunk edges: one row, uneven, whole, beyond
def test_chunked_loss_and_gradients_match_the_unfused_reference(dtype, tolerance, reduction, lora, chunk_rows):
    x, weight, target, head_lora = _inputs(dtype, lora=lora)
    ref_loss, ref_grads = _loss_and_grads(linear_cross_entropy_reference, x, weight, target, head_lora,
                                          reduction=reduction)
    loss, grads = _loss_and_grads(linear_cross_entropy, x, weight, target, head_lora, reduction=reduction,
                                  chunk_rows=chunk_rows)
    assert loss.dtype == torch.float32
    assert abs(float(loss - ref_loss)) <= 1e-5 * abs(float(ref_loss)) * (1 if dtype == torch.float32 else 10)
    assert len(grads) == len(ref_grads)
    for grad, ref in zip(grads, ref_grads):
        assert grad.dtype == ref.dtype
        assert _relative_error(grad, ref) < tolerance


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("block_rows, vocab_chunk", [(1, 1), (8, 7), (TOKENS, VOCAB), (1000, 1000)])
def test_vocabulary_chunks_with_online_sums_match_the_unfused_reference(dtype, tolerance, reduction, block_rows,
                                                                         vocab_chunk):
    # chunk edges: one row by one class, uneven both ways, whole, beyond
    x, weight, target, _ = _inputs(dtype, lora=False, train_weight=False)
    ref_loss, (ref_grad,) = _loss_and_grads(linear_cross_entropy_reference, x, weight, target, None,
                                            reduction=reduction)
    loss, (grad,) = _loss_and_grads(linear_cross_entropy, x, weight, target, None, reduction=reduction,
                                    chunk_rows=block_rows, vocab_chunk=vocab_chunk)
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))  # the logits rounded as torch rounds them
    assert grad.dtype == dtype
    assert _relative_error(grad, ref_grad) < tolerance
    assert torch.all(grad[::5] == 0)  # ignored tokens


def test_every_token_computed_and_the_ignored_masked_off_the_cpu(monkeypatch):
    # a GPU's count of the counted tokens is a host sync: every row goes through, weighted 0 if ignored. This CPU
    # has no GPU: the other devices' row selection is put in place of the CPU's
    from fxmem.kernels import linear_cross_entropy as module
    # a meta tensor has no values to count (nonzero raises on it): every row, with no look at the values
    assert module._counted_rows(torch.empty(5, dtype=torch.bool, device="meta")).shape == (5,)
    monkeypatch.setattr(module, "_counted_rows", lambda valid: torch.arange(valid.numel()))
    x, weight, target, _ = _inputs(torch.float32, lora=False, train_weight=False)
    ref_loss, (ref_grad,) = _loss_and_grads(linear_cross_entropy_reference, x, weight, target, None)
    loss, (grad,) = _loss_and_grads(linear_cross_entropy, x, weight, target, None, chunk_rows=8, vocab_chunk=7)
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss))
    assert _relative_error(grad, ref_grad) < 1e-5 and torch.all(grad[::5] == 0)


def test_online_sums_survive_logits_far_apart_across_chunks():
    # the running maximum rises by 120 between chunks: exp(120) overflows float32 unless the maximum is subtracted
    x = torch.ones(4, 2, requires_grad=True)
    weight = torch.tensor([[0.0, 0.0], [1.0, 1.0], [60.0, 60.0], [-50.0, -50.0], [60.0, 59.0]])
    target = torch.tensor([0, 2, 4, 3])
    ref_loss, (ref_grad,) = _loss_and_grads(linear_cross_entropy_reference, x, weight, target, None)
    loss, (grad,) = _loss_and_grads(linear_cross_entropy, x, weight, target, None, chunk_rows=3, vocab_chunk=2)
    assert torch.isfinite(loss) and torch.allclose(loss, ref_loss, rtol=1e-6)
    assert _relative_error(grad, ref_grad) < 1e-6


def test_a_first_chunk_of_minus_infinity_logits_stays_finite():
    # fp16 overflow makes a whole chunk -inf: its shift is 0, not -inf - -inf = nan
    x = torch.tensor([[300.0, 300.0]], dtype=torch.float16, requires_grad=True)
    weight = torch.tensor([[-200.0, -200.0], [0.01, 0.01], [0.02, 0.0]], dtype=torch.float16)
    target = torch.tensor([1])
    ref_loss, (ref_grad,) = _loss_and_grads(linear_cross_entropy_reference, x, weight, target, None)
    loss, (grad,) = _loss_and_grads(linear_cross_entropy, x, weight, target, None, chunk_rows=4, vocab_chunk=1)
    assert torch.isfinite(ref_loss) and torch.allclose(loss, ref_loss, rtol=1e-3)
    assert torch.allclose(grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-4)


def test_float64_logits_are_summed_in_float64():
    x, weight, target, _ = _inputs(torch.float64, lora=False, train_weight=False)
    # a sum, and no scale downstream: the loss (and so the gradient it gets) and the mean's 1 / count are float32
    kwargs = {"logits_dtype": torch.float64, "reduction": "sum"}
    (ref_grad,) = torch.autograd.grad(linear_cross_entropy_reference(x, weight, target, **kwargs), x)
    (grad,) = torch.autograd.grad(linear_cross_entropy(x, weight, target, chunk_rows=8, vocab_chunk=7, **kwargs), x)
    assert grad.dtype == torch.float64
    assert float((grad - ref_grad).abs().max() / ref_grad.abs().max()) < 1e-12


def test_a_frozen_weight_gets_no_gradient_and_ignored_tokens_none_at_all():
    x, weight, target, _ = _inputs(torch.float32, lora=False, train_weight=False, ignored_every=2)
    loss = linear_cross_entropy(x, weight, target, chunk_rows=8)
    loss.backward()
    assert weight.grad is None
    assert torch.all(x.grad[::2] == 0) and torch.all(x.grad[1::2].abs().sum(1) > 0)


def test_every_token_ignored_gives_torchs_nan_mean_and_zero_gradients():
    x, weight, target, _ = _inputs(torch.float32, lora=False, ignored_every=1)
    ref = linear_cross_entropy_reference(x, weight, target)
    loss = linear_cross_entropy(x, weight, target, chunk_rows=8)
    assert torch.isnan(ref) and torch.isnan(loss)
    loss.backward()
    assert torch.all(x.grad == 0) and torch.all(weight.grad == 0)


def test_a_sum_over_a_custom_ignore_index_matches_torch():
    x, weight, target, _ = _inputs(torch.float32, lora=False)
    target[target == -100] = 7
    ref = linear_cross_entropy_reference(x, weight, target, ignore_index=7, reduction="sum")
    assert torch.allclose(linear_cross_entropy(x, weight, target, ignore_index=7, reduction="sum", chunk_rows=5),
                          ref, rtol=1e-6)


def test_the_step_never_holds_the_whole_logits():
    tokens, vocab = 512, 4096
    x = torch.randn(tokens, 64, requires_grad=True)
    weight = torch.randn(vocab, 64) * 0.1
    target = torch.randint(0, vocab, (tokens,))
    logits = tokens * vocab * 4

    def step(loss_fn, **kwargs):
        return lambda: loss_fn(x, weight, target, **kwargs).backward()

    assert peak_memory(step(linear_cross_entropy_reference), "cpu") >= 2 * logits  # logits + log-probabilities
    chunked = peak_memory(step(linear_cross_entropy, chunk_rows=64), "cpu")
    assert chunked < logits / 4  # a chunk of logits (1/8) and the input's gradient
    online = peak_memory(step(linear_cross_entropy, chunk_rows=64, vocab_chunk=512), "cpu")
    gradient = x.numel() * 4
    # the input's gradient twice (in backward: the forward's, and it scaled) and less in forward: the gradient and
    # a block: one chunk of 64 x 512 float32 logits, the block's input, target rows and float32 weighted sum
    # (64 x 64 each); 8 KiB of token indices and row sums
    assert 2 * gradient <= online <= 2 * gradient + 64 * 512 * 4 + 3 * 64 * 64 * 4 + 8192


@pytest.mark.parametrize("kwargs, message", [
    ({"reduction": "none"}, "reduction must be one of mean, sum; got 'none'"),
    ({"chunk_rows": 0}, "chunk_rows must be >= 1; got 0"),
    ({"vocab_chunk": 0}, "vocab_chunk must be >= 1 or None; got 0"),
    ({"vocab_chunk": 8}, r"vocab_chunk needs a head that does not train and has no LoRA .*pass vocab_chunk=None"),
])
def test_bad_arguments_are_refused_naming_the_valid_ones(kwargs, message):
    x, weight, target, _ = _inputs(torch.float32, lora=False)  # the weight trains
    with pytest.raises(ValueError, match=message):
        linear_cross_entropy(x, weight, target, **kwargs)


def test_mismatched_shapes_are_refused():
    x, weight, target, _ = _inputs(torch.float32, lora=False)
    with pytest.raises(ValueError, match=r"expected x \(tokens, hidden\).*got \(37, 16\), \(50, 16\) and \(36,\)"):
        linear_cross_entropy(x, weight, target[1:])


def test_every_output_is_on_the_inputs_device():
    # An empty gradient made on the CPU would put a CPU tensor in a CUDA graph, which turns inductor's CUDA graphs
    # off. On meta tensors the op runs its fake: the shapes and devices compiled code is built against.
    x, weight = torch.empty(6, 8, device="meta"), torch.empty(10, 8, device="meta")
    target = torch.zeros(6, dtype=torch.long, device="meta")
    outputs = torch.ops.fxmem.linear_cross_entropy(x, weight, target, None, None, 1.0, -100, True, 4, 0,
                                                   torch.float32, False, False, False)
    assert [o.device.type for o in outputs] == ["meta"] * 5
    # and the real op makes its empty gradients like the input (the old torch.empty(0) was CPU float32)
    x, weight = torch.randn(6, 8, dtype=torch.bfloat16), torch.randn(10, 8, dtype=torch.bfloat16)
    target = torch.zeros(6, dtype=torch.long)
    outputs = torch.ops.fxmem.linear_cross_entropy(x, weight, target, None, None, 1.0, -100, True, 4, 0,
                                                   torch.float32, False, False, False)
    assert [(o.numel(), o.dtype) for o in outputs[1:]] == [(0, torch.bfloat16)] * 4


# bf16 where a block casts (the online chunk upcasts the products and the head's rows); one compilation each
@pytest.mark.parametrize("block, dtype", [("rows", torch.float32), ("online_chunk", torch.bfloat16),
                                          ("online_block_end", torch.float32)])
def test_each_loss_block_is_one_generated_kernel_with_no_aten_op_between(block, dtype):
    from torch._inductor.utils import run_and_get_code

    from fxmem.kernels import linear_cross_entropy as module
    rows, vocab, hidden = 8, 50, 16
    products, target = torch.randn(rows, vocab).to(dtype), torch.randint(0, vocab, (rows,))
    valid, row_weight = target >= 3, torch.tensor(0.1)
    running_max, running_sum = torch.full((rows, 1), float("-inf")), torch.zeros(rows, 1)
    weighted_rows = torch.zeros(rows, hidden)
    fused, args = {
        "rows": (module._FUSED_SOFTMAX_GRADIENT, (products, None, 0.0, target, valid, row_weight, torch.float32)),
        "online_chunk": (module._FUSED_ONLINE_CHUNK, (products, torch.randn(vocab, hidden).to(dtype), running_max,
                                                      running_sum, weighted_rows, torch.float32)),
        "online_block_end": (module._FUSED_ONLINE_BLOCK_END, (
            torch.randn(rows, hidden).to(dtype), torch.randn(rows, hidden).to(dtype), valid, row_weight,
            torch.zeros(rows, 1), torch.ones(rows, 1), weighted_rows, torch.float32)),
    }[block]
    with torch._inductor.config.patch(force_disable_caches=True):  # a cache hit would generate no code to read
        _, codes = run_and_get_code(fused.compiled, *args)
    (code,) = codes
    call = code[code.index("def call("):]
    assert len(re.findall(r"\bcpp_fused_\w+\(", call)) == 1
    assert "aten." not in call and "extern_kernels." not in call


def test_a_block_inductor_cannot_compile_runs_eagerly_after_a_warning_and_other_errors_propagate(monkeypatch, lenient):
    from fxmem.kernels import linear_cross_entropy as module
    x, weight, target, _ = _inputs(torch.float32, lora=False, train_weight=False)
    ref_loss, (ref_grad,) = _loss_and_grads(linear_cross_entropy_reference, x, weight, target, None)
    fused = module._Fused(module._online_chunk)
    monkeypatch.setattr(module, "_FUSED_ONLINE_CHUNK", fused)

    def cannot_compile(*args):
        raise torch._dynamo.exc.Unsupported("no C++ compiler here")

    monkeypatch.setattr(fused, "compiled", cannot_compile)
    with pytest.warns(FallbackWarning, match="runs _online_chunk eagerly: inductor could not compile it "
                                            r"\(Unsupported: no C\+\+ compiler here"):
        loss, (grad,) = _loss_and_grads(linear_cross_entropy, x, weight, target, None, chunk_rows=8, vocab_chunk=7)
    assert fused.compiled is None  # once: the eager function from then on
    assert abs(float(loss - ref_loss)) <= 1e-6 * abs(float(ref_loss)) and _relative_error(grad, ref_grad) < 1e-5

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("out of memory")

    monkeypatch.setattr(fused, "compiled", out_of_memory)  # not a compile error: it may have written its inputs
    with pytest.raises(torch.OutOfMemoryError):
        linear_cross_entropy(x, weight, target, chunk_rows=8, vocab_chunk=7)
