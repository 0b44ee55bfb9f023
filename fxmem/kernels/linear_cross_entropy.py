"""The LM head and its cross-entropy in chunks of tokens: the (tokens x vocabulary) logits never exist whole.

``linear_cross_entropy`` is exact: for each chunk of rows it computes the logits (``x W^T``, plus a LoRA term
``scale (x A^T) B^T`` when the head has one), their log-sum-exp, the loss, and the gradient of the loss with
respect to the logits, which it turns at once into the chunk's gradients for the head's input, weight and LoRA
factors. The loss is a scalar, so its gradient is a scalar: the backward multiplies what the forward already
computed. That takes one head matmul fewer than recomputing the logits in backward (the forward would compute
them, the backward again), and no more than the unfused loss: one product for the logits, one per gradient.

What lives from forward to backward is the head input's gradient (the size of the head input) and, when they
train, the head's weight and LoRA gradients; at most one chunk of logits, in the loss's dtype, exists at a time.
``linear_cross_entropy_reference`` is the unfused torch computation it is tested against.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


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
                         logits_dtype: torch.dtype = torch.float32, chunk_rows: int = 1024) -> Tensor:
    """The loss of ``linear_cross_entropy_reference``, ``chunk_rows`` tokens of logits at a time.

    x: (tokens, hidden); weight: (vocabulary, hidden); target: (tokens,) class indices, ``ignore_index`` for a
    token that does not count. reduction: "mean" over the counted tokens, or "sum".
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    if x.dim() != 2 or weight.dim() != 2 or target.dim() != 1 or x.shape[0] != target.shape[0] \
            or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x (tokens, hidden), weight (vocabulary, hidden) and target (tokens,); got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    a, b, scale = lora if lora is not None else (None, None, 0.0)
    lora_grad = lora is not None and (a.requires_grad or b.requires_grad)
    return _chunked_op(x, weight, target, a, b, scale, ignore_index, reduction == "mean", chunk_rows,
                       logits_dtype, x.requires_grad, weight.requires_grad, lora_grad)[0]


def _chunk_logits(x: Tensor, weight: Tensor, a: Tensor | None, b: Tensor | None, scale: float,
                  dtype: torch.dtype) -> Tensor:
    logits = x @ weight.t()
    if a is not None:
        logits.add_((x @ a.t()) @ b.t(), alpha=scale)
    return logits.to(dtype)


@torch.library.custom_op("fxmem::linear_cross_entropy", mutates_args=())
def _chunked_op(x: Tensor, weight: Tensor, target: Tensor, lora_a: Tensor | None, lora_b: Tensor | None,
                lora_scale: float, ignore_index: int, mean: bool, chunk_rows: int, logits_dtype: torch.dtype,
                input_grad: bool, weight_grad: bool, lora_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, d loss / d x, d loss / d weight, d loss / d A, d loss / d B); a gradient not asked for is empty."""
    rows = x.shape[0]
    valid = target != ignore_index
    # mean: every counted token weighs 1 / count; a batch with none counts gives nan, as torch's does
    row_weight = 1.0 / valid.sum().to(torch.float32) if mean else torch.ones((), device=x.device)
    loss = torch.zeros((), dtype=torch.float32, device=x.device)
    grad_x = torch.empty_like(x) if input_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if weight_grad else None
    grad_a = torch.zeros(lora_a.shape, dtype=torch.float32, device=x.device) if lora_grad else None
    grad_b = torch.zeros(lora_b.shape, dtype=torch.float32, device=x.device) if lora_grad else None
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
    that its logits are freed before the next chunk's are allocated."""
    target = torch.where(valid, target, 0).unsqueeze(1)
    logits = _chunk_logits(x, weight, lora_a, lora_b, lora_scale, logits_dtype)
    picked = logits.gather(1, target).squeeze(1)
    # in place from here: the chunk's logits become exp(logits - max), then softmax, then the gradient
    row_max = logits.amax(1, keepdim=True)
    total = logits.sub_(row_max).exp_().sum(1, keepdim=True)
    lse = row_max.squeeze(1) + total.squeeze(1).log()
    grad = logits.div_(total)
    grad.scatter_add_(1, target, torch.full_like(picked, -1.0).unsqueeze(1))
    grad = grad.mul_(torch.where(valid, row_weight, 0).unsqueeze(1).to(grad.dtype)).to(x.dtype)
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
    return torch.where(valid, lse - picked, 0).sum()


def _in_dtype(grad: Tensor | None, param: Tensor | None, like: Tensor) -> Tensor:
    """A gradient in its parameter's dtype; one not computed is empty (each its own: outputs may not alias), made
    like ``like`` (the input): a CPU tensor in a CUDA graph would turn inductor's CUDA graphs off."""
    return like.new_empty(0) if grad is None else grad.to(param.dtype)


@_chunked_op.register_fake
def _(x, weight, target, lora_a, lora_b, lora_scale, ignore_index, mean, chunk_rows, logits_dtype, input_grad,
      weight_grad, lora_grad):
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
            None, None, None, None, None, None, None, None)


_chunked_op.register_autograd(_backward, setup_context=_setup_context)
