"""The "time" mode of RunLoRA's chooser: run every order once on the device and keep the fastest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from fxmem.cost_model.lora_orders import (
    BACKWARD_ORDERS,
    FORWARD_ORDERS,
    GRADIENTS,
    LoraShape,
    OrderChoice,
    backward_cost,
    default_cost,
    forward_cost,
)
from fxmem.kernels.runlora import lora_backward, lora_forward

_CHOICES: dict[tuple[LoraShape, frozenset[str], str], OrderChoice] = {}
REPEATS = 3


def _median_seconds(run: Callable[[], object], device: torch.device) -> float:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    run()  # warm-up: allocator, kernel selection
    samples = []
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        run()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def choose_by_time(shape: LoraShape, needs: frozenset[str] = frozenset(GRADIENTS),
                   device: torch.device | str = "cpu") -> OrderChoice:
    """The fastest forward and backward order for ``shape`` on ``device``, measured once per process."""
    device = torch.device(device)
    key = (shape, frozenset(needs), str(device))
    if key in _CHOICES:
        return _CHOICES[key]
    n, i, o, r = shape.tokens, shape.in_features, shape.out_features, shape.rank
    generator = torch.Generator(device=device).manual_seed(0)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, device=device, dtype=shape.dtype)

    # Called at compile time, inside AOTAutograd's fake-tensor mode: without leaving it, the orders would run on
    # fake tensors and the "fastest" would be noise.
    with _disable_current_modes(), torch.no_grad():
        x, weight, lora_a, lora_b, grad_y = rand(n, i), rand(o, i), rand(r, i), rand(o, r), rand(n, o)
        forward = min(FORWARD_ORDERS, key=lambda order: _median_seconds(
            lambda: lora_forward(order, x, weight, None, lora_a, lora_b, 1.0), device))
        backward = min(BACKWARD_ORDERS, key=lambda order: _median_seconds(
            lambda: lora_backward(order, grad_y, x, weight, lora_a, lora_b, 1.0, frozenset(needs)), device))
    f, b = forward_cost(forward, shape), backward_cost(backward, shape, needs)
    choice = OrderChoice(forward, backward, type(f)(f.flops + b.flops, f.bytes_moved + b.bytes_moved),
                         default_cost(shape, needs))
    _CHOICES[key] = choice
    return choice
