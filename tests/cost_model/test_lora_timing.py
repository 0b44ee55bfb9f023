from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from fxmem import Backend, Config, timing
from fxmem.cost_model import lora_timing
from fxmem.cost_model.lora_orders import (
    BACKWARD_ORDERS,
    FORWARD_ORDERS,
    SPLIT_DX_BACKWARD_ORDERS,
    LoraShape,
    backward_cost,
    choose_by_flops,
    default_cost,
    forward_cost,
)
from fxmem.cost_model.lora_timing import choose_by_time
from tests.conftest import tiny_model

SHAPE = LoraShape(32, 24, 40, 4)


@pytest.fixture(autouse=True)
def empty_cache(monkeypatch):
    monkeypatch.setattr(lora_timing, "_CHOICES", {})


class FakeClock:
    """Stands in for ``time`` and for the orders: running an order advances the clock by that order's seconds."""

    def __init__(self, seconds: dict[str, float]):
        self.now = 0.0
        self.seconds = seconds
        self.runs: Counter[str] = Counter()

    def perf_counter(self) -> float:
        return self.now

    def run(self, order: str, *tensors: object) -> None:
        self.runs[order] += 1
        self.now += self.seconds[order]


@pytest.fixture
def clock(monkeypatch):
    # forward2 and backward6: never the FLOPs chooser's pick for SHAPE, so the choice can only come from the clock.
    seconds = {order: 1.0 for order in (*FORWARD_ORDERS, *BACKWARD_ORDERS)} | {"forward2": 0.5, "backward6": 0.25}
    fake = FakeClock(seconds)
    monkeypatch.setattr(timing, "time", fake)  # the clock lora_timing times with (timing.step_times)
    monkeypatch.setattr(lora_timing, "lora_forward", fake.run)
    monkeypatch.setattr(lora_timing, "lora_backward", fake.run)
    return fake


def test_time_mode_picks_the_fastest_orders_and_measures_each_once_per_shape(clock):
    flops_choice = choose_by_flops(SHAPE)
    assert (flops_choice.forward, flops_choice.backward) != ("forward2", "backward6")
    choice = choose_by_time(SHAPE)
    assert (choice.forward, choice.backward) == ("forward2", "backward6")
    # every candidate: one warm-up and REPEATS timed runs, no more
    assert clock.runs == Counter({order: 1 + lora_timing.REPEATS for order in (*FORWARD_ORDERS, *BACKWARD_ORDERS)})
    f, b = forward_cost("forward2", SHAPE), backward_cost("backward6", SHAPE)
    assert choice.cost.flops == f.flops + b.flops and choice.default == default_cost(SHAPE)

    assert choose_by_time(SHAPE) is choice  # cached: nothing runs again
    assert sum(clock.runs.values()) == 10 * (1 + lora_timing.REPEATS)
    choose_by_time(LoraShape(64, 24, 40, 4))  # another shape is measured
    assert sum(clock.runs.values()) == 2 * 10 * (1 + lora_timing.REPEATS)
    choose_by_time(SHAPE, frozenset({"a", "b"}))  # and so is the same shape needing other gradients
    assert sum(clock.runs.values()) == 3 * 10 * (1 + lora_timing.REPEATS)


def test_time_mode_with_fp32_adapters_on_bf16_times_only_the_orders_that_keep_s_b_a_out_of_w(clock):
    mixed = LoraShape(32, 24, 40, 4, torch.bfloat16, adapter_dtype=torch.float32)
    choice = choose_by_time(mixed)
    assert (choice.forward, choice.backward) == ("forward1", "backward6")
    assert clock.runs == Counter({order: 1 + lora_timing.REPEATS
                                  for order in ("forward1", "backward1", "backward2", "backward3", "backward6")})


def test_time_mode_on_the_real_clock_picks_valid_orders_and_caches_them():
    choice = choose_by_time(SHAPE, frozenset({"a", "b"}))
    assert choice.forward in FORWARD_ORDERS and choice.backward in BACKWARD_ORDERS
    assert choice.default == default_cost(SHAPE, frozenset({"a", "b"}))
    assert choose_by_time(SHAPE, frozenset({"a", "b"})) is choice
    mixed = choose_by_time(LoraShape(32, 24, 40, 4, torch.bfloat16, adapter_dtype=torch.float32))
    assert mixed.forward == "forward1" and mixed.backward in SPLIT_DX_BACKWARD_ORDERS


def test_the_runlora_pass_in_time_mode_times_real_tensors_once_per_layer_shape(monkeypatch):
    timed: list[tuple[str, torch.Tensor]] = []
    real_forward = lora_timing.lora_forward

    def spy(order, x, *rest):
        timed.append((order, x))
        return real_forward(order, x, *rest)

    monkeypatch.setattr(lora_timing, "lora_forward", spy)
    model, batch = tiny_model("llama", lora=True)
    backend = Backend(Config(runlora="time"), lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    [record] = [r for r in backend.regions[0].passes if r.name == "runlora"]
    assert record.note.startswith("14 LoRA linear(s) reordered")  # 2 layers x 7 linears
    # compile time runs inside AOTAutograd's fake mode; the timing must not measure fake tensors
    assert timed and not any(isinstance(x, FakeTensor) for _, x in timed)
    # measured once per (shape, gradients needed), not once per layer: 3 shapes, fewer than 14 linears
    assert {(s.in_features, s.out_features) for s, _, _ in lora_timing._CHOICES} == {(64, 64), (64, 172), (172, 64)}
    assert len(lora_timing._CHOICES) < 14
    assert len(timed) == len(lora_timing._CHOICES) * len(FORWARD_ORDERS) * (1 + lora_timing.REPEATS)
