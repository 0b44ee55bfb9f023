"""The LM head and its cross-entropy in chunks: the (tokens x vocabulary) logits never exist whole.

``linear_cross_entropy`` is exact, and computes the loss's gradients in the forward: the loss is a scalar, so its
gradient is a scalar, and the backward multiplies what the forward already computed. That takes one head matmul
fewer than recomputing the logits in backward, and no more than the unfused loss: one product for the logits,
one per gradient. What lives from forward to backward is the head input's gradient (the size of the head input)
and, when they train, the head's weight and LoRA gradients. Two ways to chunk:

- Rows and the whole vocabulary (``vocab_chunk=None``; the only one when the head trains or has a LoRA): for
  each chunk of rows, the logits (``x W^T``, plus ``scale (x A^T) B^T`` for a LoRA), their log-sum-exp, the loss,
  and the logits' gradient, turned at once into the chunk's gradients for the head's input, weight and factors.
  A chunk holds rows x vocabulary float32 logits.
- Rows and vocabulary both (a head that does not train): for each block of counted tokens, the vocabulary a
  chunk at a time, the log-sum-exp and the softmax-weighted sum of the head's rows accumulated online, as flash
  attention accumulates its softmax: ``d loss / d x = sum_v softmax_v W_v - W_target``. A chunk holds rows x
  ``vocab_chunk`` logits; the head's products stay as thick as whole-vocabulary ones, and the vocabulary is read
  once per block. On the CPU ignored tokens are skipped; elsewhere they are computed and masked (their count would
  be a host sync).

Between the head's products, each chunk's element-wise work (the log-sum-exp, the loss, the logits' gradient;
the running sums of the online softmax) is one function compiled by inductor (``_Fused``): fused kernels (C++ on
the CPU, Triton on a GPU) instead of a dozen aten passes over the chunk, with no host sync. Where inductor cannot
compile it, the same function runs eagerly, after one warning (unfused: its intermediates then take a few chunks of
memory).

``linear_cross_entropy_reference`` is the unfused torch computation both are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from fxmem.fallback import fall_back


class HeadLora(NamedTuple):
    """A LoRA on the head, as PEFT computes it: ``x W^T + (x A^T) B^T * scale``."""

    a: Tensor  # (rank, hidden)
    b: Tensor  # (vocabulary, rank)
    scale: float


REDUCTIONS = ("mean", "sum")


def linear_cross_entropy_reference(x: Tensor, weight: Tensor, target: Tensor, *, lora: HeadLora | None = None,
                                   ignore_index: int = -100, reduction: str = "mean",
                                   logits_dtype: torch.dtype = torch.float32) -> Tensor:
    """``cross_entropy(linear(x, weight) [+ LoRA], target)`` as torch computes it, the logits whole."""
    logits = torch.nn.functional.linear(x, weight)
    if lora is not None:
        logits = logits + torch.nn.functional.linear(torch.nn.functional.linear(x, lora.a), lora.b) * lora.scale
    return torch.nn.functional.cross_entropy(logits.to(logits_dtype), target, ignore_index=ignore_index,
                                             reduction=reduction)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, *, lora: HeadLora | None = None,
                         ignore_index: int = -100, reduction: str = "mean",
                         logits_dtype: torch.dtype = torch.float32, chunk_rows: int = 1024,
                         vocab_chunk: int | None = None) -> Tensor:
    """The loss of ``linear_cross_entropy_reference``, ``chunk_rows`` tokens of logits at a time.

    x: (tokens, hidden); weight: (vocabulary, hidden); target: (tokens,) class indices, ``ignore_index`` for a
    token that does not count. reduction: "mean" over the counted tokens, or "sum". vocab_chunk: the classes per
    chunk, for a head that does not train and has no LoRA; None: the whole vocabulary.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    if x.dim() != 2 or weight.dim() != 2 or target.dim() != 1 or x.shape[0] != target.shape[0] \
            or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x (tokens, hidden), weight (vocabulary, hidden) and target (tokens,); got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    if vocab_chunk is not None:
        if vocab_chunk < 1:
            raise ValueError(f"vocab_chunk must be >= 1 or None; got {vocab_chunk}")
        if lora is not None or weight.requires_grad:
            raise ValueError("vocab_chunk needs a head that does not train and has no LoRA (its gradient needs each "
                             "row's whole log-sum-exp); pass vocab_chunk=None")
    a, b, scale = lora if lora is not None else (None, None, 0.0)
    lora_grad = lora is not None and (a.requires_grad or b.requires_grad)
    return _chunked_op(x, weight, target, a, b, scale, ignore_index, reduction == "mean", chunk_rows,
                       vocab_chunk or 0, logits_dtype, x.requires_grad, weight.requires_grad, lora_grad)[0]


def _compile_errors() -> tuple[type[Exception], ...]:
    """What torch.compile raises when it cannot compile a function (dynamo, the backend, inductor): raised before any
    kernel runs, so the eager function may run in its place on the untouched inputs."""
    from torch._dynamo import exc as dynamo_errors
    from torch._inductor import exc as inductor_errors
    found = (getattr(dynamo_errors, "BackendCompilerFailed", None), getattr(dynamo_errors, "Unsupported", None),
             getattr(dynamo_errors, "InternalTorchDynamoError", None), getattr(inductor_errors, "InductorError", None),
             getattr(inductor_errors, "CppCompileError", None))
    return tuple(error for error in found if error is not None)


class _Fused:
    """``function`` compiled by inductor at its first call (shapes dynamic: a chunk's rows and classes vary), or
    ``function`` itself where that compilation fails (no C++ compiler, a torch without inductor), after a warning.
    Any other error (out of memory, a failure while a CUDA graph is captured) propagates: the function writes into
    its inputs, and running it again after a partial run would count a chunk twice."""

    def __init__(self, function: Callable) -> None:
        self.function = function
        # rounded where eager rounds (a bf16 sum before its cast to float32): the loss stays torch's
        self.compiled: Callable | None = torch.compile(function, dynamic=True, fullgraph=True,
                                                       options={"emulate_precision_casts": True})

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except _compile_errors() as error:
                fall_back(f"fxmem's chunked loss runs {self.function.__name__} eagerly: inductor could not compile "
                          f"it ({type(error).__name__}: {error})")
                self.compiled = None  # after the warning: strict mode raises at every call
        return self.function(*args)


def _softmax_gradient_(products: Tensor, lora_products: Tensor | None, lora_scale: float, target: Tensor,
                       valid: Tensor, row_weight: Tensor, logits_dtype: torch.dtype) -> Tensor:
    """A chunk of rows over the whole vocabulary: writes d loss / d logits over ``products`` (x W^T, in x's dtype)
    and returns the chunk's summed loss. The logits (plus the LoRA's term, in ``logits_dtype``) exist only inside
    the fused kernels."""
    logits = products if lora_products is None else products + lora_products * lora_scale
    logits = logits.to(logits_dtype)
    target = torch.where(valid, target, 0).unsqueeze(1)
    picked = logits.gather(1, target).squeeze(1)
    row_max = logits.amax(1, keepdim=True)
    lse = row_max + (logits - row_max).exp().sum(1, keepdim=True).log()
    # exp(logits - lse) again, not the exponentials of the sum kept: they would take a chunk of memory
    one_hot = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0) == target
    row_scale = torch.where(valid, row_weight, 0).unsqueeze(1).to(logits.dtype)
    products.copy_(((logits - lse).exp() - one_hot.to(logits.dtype)) * row_scale)
    return torch.where(valid, lse.squeeze(1) - picked, 0).sum()


def _online_chunk(products: Tensor, chunk: Tensor, running_max: Tensor, running_sum: Tensor,
                  weighted_rows: Tensor | None, logits_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One chunk of classes of a block: updates the running maximum and sum (and rescales the weighted rows) in
    place; returns the chunk's unnormalized probabilities (over ``products`` where that is their dtype) and the
    head's rows of the chunk, both in the sums' dtype."""
    # torch's logits: the model-dtype product in the loss's dtype; then the sums' dtype
    logits = products.to(logits_dtype).to(running_sum.dtype)
    new_max = torch.maximum(running_max, logits.amax(1, keepdim=True))
    # a row whose logits so far are all -inf (fp16 overflow) shifts by 0: -inf - -inf would be nan
    shift = torch.where(new_max == float("-inf"), 0, new_max)
    rescale = (running_max - shift).exp()  # the first chunk: exp(-inf) = 0
    probabilities = (logits - shift).exp()
    running_sum.copy_(running_sum * rescale + probabilities.sum(1, keepdim=True))
    running_max.copy_(new_max)
    if weighted_rows is not None:
        weighted_rows.mul_(rescale)
    if products.dtype == probabilities.dtype:
        probabilities = products.copy_(probabilities)
    return probabilities, chunk.to(running_sum.dtype)


def _online_block_end(x_block: Tensor, target_rows: Tensor, valid: Tensor, row_weight: Tensor, running_max: Tensor,
                      running_sum: Tensor, weighted_rows: Tensor | None, logits_dtype: torch.dtype
                      ) -> tuple[Tensor, Tensor | None]:
    """A block's summed loss and, with ``weighted_rows``, its rows of d loss / d x in x's dtype (written over
    ``weighted_rows`` where that is their dtype)."""
    compute = running_sum.dtype
    # the target's logit as torch has it: accumulated in float32, rounded to the model's dtype
    picked = torch.linalg.vecdot(x_block.to(compute), target_rows.to(compute)).to(x_block.dtype).to(logits_dtype)
    lse = (running_max + running_sum.log()).squeeze(1)
    loss = torch.where(valid, lse - picked.to(compute), 0).sum().float()
    if weighted_rows is None:
        return loss, None
    # softmax-weighted rows minus the target's, by each token's weight; over the weighted rows in x's dtype
    scale = torch.where(valid, row_weight, 0).unsqueeze(1).to(compute)
    grad = (weighted_rows / running_sum - target_rows.to(compute)) * scale
    return loss, weighted_rows.copy_(grad) if x_block.dtype == compute else grad.to(x_block.dtype)


_FUSED_SOFTMAX_GRADIENT = _Fused(_softmax_gradient_)
_FUSED_ONLINE_CHUNK = _Fused(_online_chunk)
_FUSED_ONLINE_BLOCK_END = _Fused(_online_block_end)


@torch.library.custom_op("fxmem::linear_cross_entropy", mutates_args=())
def _chunked_op(x: Tensor, weight: Tensor, target: Tensor, lora_a: Tensor | None, lora_b: Tensor | None,
                lora_scale: float, ignore_index: int, mean: bool, chunk_rows: int, vocab_chunk: int,
                logits_dtype: torch.dtype, input_grad: bool, weight_grad: bool, lora_grad: bool
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, d loss / d x, d loss / d weight, d loss / d A, d loss / d B); a gradient not asked for is empty.
    vocab_chunk 0: the whole vocabulary per chunk of rows."""
    rows = x.shape[0]
    valid = target != ignore_index
    # mean: every counted token weighs 1 / count; a batch with none counts gives nan, as torch's does
    row_weight = 1.0 / valid.sum().to(torch.float32) if mean else torch.ones((), device=x.device)
    grad_x = torch.empty_like(x) if input_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if weight_grad else None
    grad_a = torch.zeros(lora_a.shape, dtype=torch.float32, device=x.device) if lora_grad else None
    grad_b = torch.zeros(lora_b.shape, dtype=torch.float32, device=x.device) if lora_grad else None
    if vocab_chunk:
        loss = _online_loss(x, weight, target, valid, row_weight, logits_dtype, chunk_rows, vocab_chunk, grad_x)
    else:
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for start in range(0, rows, chunk_rows):
            end = min(start + chunk_rows, rows)
            loss += _chunk(x[start:end], target[start:end], valid[start:end], row_weight, weight, lora_a, lora_b,
                           lora_scale, logits_dtype, None if grad_x is None else grad_x[start:end], grad_weight,
                           grad_a, grad_b)
    return (loss * row_weight, _in_dtype(grad_x, x, x), _in_dtype(grad_weight, weight, x),
            _in_dtype(grad_a, lora_a, x), _in_dtype(grad_b, lora_b, x))


def _chunk(x: Tensor, target: Tensor, valid: Tensor, row_weight: Tensor, weight: Tensor, lora_a: Tensor | None,
           lora_b: Tensor | None, lora_scale: float, logits_dtype: torch.dtype, grad_x: Tensor | None,
           grad_weight: Tensor | None, grad_a: Tensor | None, grad_b: Tensor | None) -> Tensor:
    """One chunk's summed loss; writes its rows of ``grad_x`` and adds into the others. A function of its own so
    that its products are freed before the next chunk's are allocated."""
    grad = x @ weight.t()  # the head's product, overwritten by the logits' gradient
    lora_products = None if lora_a is None else (x @ lora_a.t()) @ lora_b.t()
    loss = _FUSED_SOFTMAX_GRADIENT(grad, lora_products, lora_scale, target, valid, row_weight, logits_dtype)
    del lora_products
    if grad_x is not None:
        torch.mm(grad, weight, out=grad_x)
    if grad_weight is not None:
        grad_weight += (grad.t() @ x).float()
    if lora_a is not None:
        grad_xa = grad @ lora_b  # d loss / d (x A^T), before the scale
        if grad_x is not None:
            grad_x.add_(grad_xa @ lora_a, alpha=lora_scale)
        if grad_a is not None:
            grad_a += (grad_xa.t() @ x).float() * lora_scale
            grad_b += (grad.t() @ (x @ lora_a.t())).float() * lora_scale
    return loss


def _counted_rows(valid: Tensor) -> Tensor:
    """The rows of the tokens that count on the CPU, where counting them costs nothing; every row elsewhere: a
    GPU's count is a host sync (and cannot be taken in a CUDA graph capture), so its ignored tokens are computed and
    masked."""
    if valid.device.type == "cpu":
        return valid.nonzero().squeeze(1)
    return torch.arange(valid.numel(), device=valid.device)


def _online_loss(x: Tensor, weight: Tensor, target: Tensor, valid: Tensor, row_weight: Tensor,
                 logits_dtype: torch.dtype, block_rows: int, vocab_chunk: int, grad_x: Tensor | None) -> Tensor:
    """The summed loss of the counted tokens, ``block_rows`` of them by ``vocab_chunk`` classes at a time; writes
    ``grad_x`` (zero for an ignored token). Per row: the running maximum m and sum s of exp(logit - m) and,
    rescaled with them, the sum of exp(logit - m) W_v, all in float32 (products of the model's dtype upcast:
    summed over the vocabulary, their roundings would add up where softmax and target nearly cancel)."""
    compute = torch.promote_types(torch.promote_types(x.dtype, logits_dtype), torch.float32)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    if grad_x is not None:
        grad_x.zero_()
    counted = _counted_rows(valid)
    for start in range(0, counted.numel(), block_rows):
        rows = counted[start:start + block_rows]
        x_block, block_valid = x.index_select(0, rows), valid.index_select(0, rows)
        target_rows = weight.index_select(0, torch.where(block_valid, target.index_select(0, rows), 0))
        running_max = torch.full((rows.numel(), 1), float("-inf"), dtype=compute, device=x.device)
        running_sum = torch.zeros((rows.numel(), 1), dtype=compute, device=x.device)
        weighted_rows = None if grad_x is None else x_block.new_zeros(x_block.shape, dtype=compute)
        for first in range(0, weight.shape[0], vocab_chunk):
            chunk = weight[first:first + vocab_chunk]
            probabilities, chunk = _FUSED_ONLINE_CHUNK(x_block @ chunk.t(), chunk, running_max, running_sum,
                                                       weighted_rows, logits_dtype)
            if weighted_rows is not None:
                weighted_rows.addmm_(probabilities, chunk)
            del probabilities, chunk  # freed before the next chunk's are made
        block_loss, block_grad = _FUSED_ONLINE_BLOCK_END(x_block, target_rows, block_valid, row_weight, running_max,
                                                         running_sum, weighted_rows, logits_dtype)
        loss += block_loss
        if block_grad is not None:
            grad_x.index_copy_(0, rows, block_grad)
    return loss


def _in_dtype(grad: Tensor | None, param: Tensor | None, like: Tensor) -> Tensor:
    """A gradient in its parameter's dtype; one not computed is empty (each its own: outputs may not alias), made
    like ``like`` (the input): a CPU tensor in a CUDA graph would turn inductor's CUDA graphs off."""
    return like.new_empty(0) if grad is None else grad.to(param.dtype)


@_chunked_op.register_fake
def _(x, weight, target, lora_a, lora_b, lora_scale, ignore_index, mean, chunk_rows, vocab_chunk, logits_dtype,
      input_grad, weight_grad, lora_grad):
    return (x.new_empty((), dtype=torch.float32), torch.empty_like(x) if input_grad else x.new_empty(0),
            weight.new_empty(weight.shape) if weight_grad else x.new_empty(0),
            lora_a.new_empty(lora_a.shape) if lora_grad else x.new_empty(0),
            lora_b.new_empty(lora_b.shape) if lora_grad else x.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*output[1:])
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, grad_loss, *_):
    grad_x, grad_weight, grad_a, grad_b = ctx.saved_tensors
    needs = ctx.needs_input_grad

    def scaled(grad: Tensor, index: int) -> Tensor | None:
        return grad * grad_loss.to(grad.dtype) if needs[index] and grad.numel() else None

    return (scaled(grad_x, 0), scaled(grad_weight, 1), None, scaled(grad_a, 3), scaled(grad_b, 4),
            None, None, None, None, None, None, None, None, None)


_chunked_op.register_autograd(_backward, setup_context=_setup_context)
