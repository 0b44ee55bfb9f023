"""The "time" mode of RunLoRA's chooser: run every order once on the device and keep the fastest."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fxmem.cost_model.lora_orders import (
    GRADIENTS,
    LoraShape,
    OrderChoice,
    order_choice,
)
from fxmem.kernels.runlora import lora_backward, lora_forward
from fxmem.timing import median, step_times

_CHOICES: dict[tuple[LoraShape, frozenset[str], str], OrderChoice] = {}
REPEATS = 3


def choose_by_time(shape: LoraShape, needs: frozenset[str] = frozenset(GRADIENTS),
                   device: torch.device | str = "cpu") -> OrderChoice:
    """The fastest forward and backward order for ``shape`` on ``device``, measured once per process."""
    device = torch.device(device)
    key = (shape, frozenset(needs), str(device))
    if key in _CHOICES:
        return _CHOICES[key]
    n, i, o, r = shape.tokens, shape.in_features, shape.out_features, shape.rank
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int, dtype: torch.dtype = shape.dtype) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=dtype)

    forwards, backwards = shape.candidate_orders()
    adapter_dtype = shape.adapter_dtype or shape.dtype
    # Called at compile time, inside AOTAutograd's fake-tensor mode: without leaving it, the orders would run on
    # fake tensors and the "fastest" would be noise. With dropout, X stands in for dropout(X): the same products.
    with _disable_current_modes(), torch.no_grad():
        x, weight, grad_y = rand(n, i), rand(o, i), rand(n, o)
        lora_a, lora_b = rand(r, i, dtype=adapter_dtype), rand(o, r, dtype=adapter_dtype)
        # one warm-up (allocator, kernel selection), then the median of REPEATS timed runs
        forward = min(forwards, key=lambda order: median(step_times(
            lambda: lora_forward(order, x, weight, None, lora_a, lora_b, 1.0), steps=REPEATS, device=device)))
        backward = min(backwards, key=lambda order: median(step_times(
            lambda: lora_backward(order, grad_y, x, weight, lora_a, lora_b, 1.0, frozenset(needs)), steps=REPEATS,
            device=device)))
    choice = order_choice(forward, backward, shape, frozenset(needs))
    _CHOICES[key] = choice
    return choice
