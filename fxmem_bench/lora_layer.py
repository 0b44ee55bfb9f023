"""Single LoRA layer forward+backward time: RunLoRA's chosen orders against PEFT's eager layer.

On the CPU, runlora_linear runs its products with W in the library measured
faster there (fxmem/cost_model/matmul_library.py's weight_libraries); the same orders with aten's
products are timed too, so that what the orders give and what the library
gives are read apart.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from fxmem.cost_model.lora_orders import LoraShape, choose_by_flops
from fxmem.cost_model.matmul_library import weight_libraries
from fxmem.kernels.runlora import runlora_linear
from fxmem.timing import interleaved_step_times, median


@dataclass(frozen=True)
class LayerTiming:
    shape: LoraShape
    forward: str
    backward: str
    libraries: tuple[str, str]  # what runs the product with W in forward and in backward
    flops_saving: float
    peft_seconds: float
    runlora_seconds: float
    speedups: tuple[float, ...]  # PEFT's time / runlora's, one per interleaved round
    order_speedups: tuple[float, ...]  # the same with aten's products: what the orders alone give

    @property
    def speedup(self) -> float:
        """Median of the per-round ratios: a round times all back to back, so the machine's drift cancels."""
        return median(self.speedups)

    @property
    def speedup_quartiles(self) -> tuple[float, float]:
        """The middle half of the per-round ratios: how far one round's reading can be trusted."""
        if len(self.speedups) < 2:
            return self.speedups[0], self.speedups[0]
        low, _, high = statistics.quantiles(self.speedups, n=4, method="inclusive")
        return low, high

    @property
    def order_speedup(self) -> float:
        return median(self.order_speedups)


def time_lora_layer(shape: LoraShape, *, steps: int, device: str = "cpu") -> LayerTiming:
    """Median fwd+bwd seconds of a PEFT LoRA Linear (eager) and of runlora_linear in the FLOPs chooser's orders,
    and the per-round ratios, also for those orders with aten's products."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(shape.in_features, shape.out_features, bias=False))
    model = get_peft_model(base, LoraConfig(r=shape.rank, lora_alpha=shape.rank, target_modules=["0"]))
    model.to(device=device, dtype=shape.dtype)
    layer = model.base_model.model[0]
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randn(shape.tokens, shape.in_features, device=device, dtype=shape.dtype, requires_grad=True)
    grad_y = torch.randn(shape.tokens, shape.out_features, device=device, dtype=shape.dtype)
    choice = choose_by_flops(shape)
    weight, lora_a, lora_b = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight

    def peft_step() -> None:
        layer(x).backward(grad_y)

    libraries = weight_libraries(x, weight)

    def runlora_step() -> None:
        runlora_linear(x, weight, None, lora_a, lora_b, 1.0, choice.forward, choice.backward,
                       libraries).backward(grad_y)

    def runlora_aten_step() -> None:
        runlora_linear(x, weight, None, lora_a, lora_b, 1.0, choice.forward, choice.backward).backward(grad_y)

    candidates = {"peft": peft_step, "runlora": runlora_step}
    if libraries != ("aten", "aten"):
        candidates["runlora, aten"] = runlora_aten_step
    times = interleaved_step_times(candidates, steps=steps, warmup=2, device=device)
    times.setdefault("runlora, aten", times["runlora"])

    def ratios(name: str) -> tuple[float, ...]:
        return tuple(p / r for p, r in zip(times["peft"], times[name], strict=True))

    return LayerTiming(shape, choice.forward, choice.backward, libraries, choice.flops_saving, median(times["peft"]),
                       median(times["runlora"]), ratios("runlora"), ratios("runlora, aten"))
