"""`fxmem hift`: plain full fine-tuning against HiFT in each order, side by side on the same batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from fxmem.finetune import round_robin
from fxmem.measure import median, peak_memory, step_times, warm_up_compiler
from fxmem.train.hift import ORDERS, HiFT
from fxmem.workloads import Workload

COMPILE_CHOICES = ("none", "fxmem", "inductor")
SCOPES = ("blocks", "model")


@dataclass
class HiFTRunResult:
    name: str
    groups: int  # k; 1 for plain full fine-tuning
    losses: list[float] = field(default_factory=list)
    # per step: gradients alive at the optimizer step, optimizer state on the device while it runs, optimizer
    # state held in CPU memory meanwhile
    gradient_bytes: list[int] = field(default_factory=list)
    device_state_bytes: list[int] = field(default_factory=list)
    offloaded_state_bytes: list[int] = field(default_factory=list)
    step_peak_bytes: int = 0  # largest over the last cycle: a step's peak allocation above its start
    seconds: list[float] = field(default_factory=list)
    graphs: int = 0  # graphs dynamo compiled during this run's steps
    eager_fallbacks: int = 0

    def final_loss(self, window: int) -> float:
        """Mean loss over the last ``window`` steps (one HiFT cycle): every run saw the same batches there."""
        tail = self.losses[-window:]
        return sum(tail) / len(tail)

    @property
    def step_seconds(self) -> float:
        return median(self.seconds[1:] or self.seconds)


class _Run:
    """One training loop (plain or HiFT), advanced a step at a time; the LR decays to zero over ``cycles``
    scheduler steps (HiFT steps its scheduler once per cycle)."""

    def __init__(self, workload: Workload, order: str | None, *, cycles: int, lr: float,
                 layers_per_group: int, compile_backend: str, scope: str, device: torch.device) -> None:
        self.setup = workload.build(device=device, lora_rank=0)
        model = self.setup.model
        self.forward: Callable = model
        if order is None:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=cycles)
            self.hift = None
            if compile_backend != "none":
                self.forward = torch.compile(model, backend=compile_backend)
        else:
            self.hift = HiFT(model, torch.optim.AdamW, lr=lr, order=order, layers_per_group=layers_per_group,
                             scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cycles))
            if compile_backend != "none" and scope == "blocks":
                self.hift.compile(backend=compile_backend)
            elif compile_backend != "none":
                self.forward = torch.compile(model, backend=compile_backend)
        self.device = device
        self.result = HiFTRunResult("full fine-tuning" if order is None else f"HiFT {order}",
                                    1 if self.hift is None else self.hift.k)

    def step(self, profile: bool) -> None:
        graphs_before = counters["stats"]["unique_graphs"]
        if profile:
            self.result.step_peak_bytes = max(self.result.step_peak_bytes, peak_memory(self._step, self.device))
        else:
            self.result.seconds += step_times(self._step, steps=1, warmup=0, device=self.device)
        self.result.graphs += counters["stats"]["unique_graphs"] - graphs_before

    def _step(self) -> None:
        loss = self.setup.loss(self.forward, next(self.setup.batches))
        loss.backward()
        model, r = self.setup.model, self.result
        r.gradient_bytes.append(_bytes(p.grad for p in model.parameters() if p.grad is not None))
        if self.hift is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            r.device_state_bytes.append(_state_bytes(self.optimizer, model.parameters()))
            r.offloaded_state_bytes.append(0)
        else:
            active = self.hift.active.parameters
            self.hift.step()
            r.device_state_bytes.append(_state_bytes(self.hift.optimizer, active))
            r.offloaded_state_bytes.append(_state_bytes(self.hift.optimizer, model.parameters())
                                           - r.device_state_bytes[-1])
            r.eager_fallbacks = len(self.hift.eager_fallbacks)
        r.losses.append(loss.item())


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(optimizer: torch.optim.Optimizer, params) -> int:
    return _bytes(v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))


def compare_hift(workload: Workload, orders: Sequence[str] = ORDERS, *, cycles: int, lr: float,
                 layers_per_group: int = 1, compile_backend: str = "none", scope: str = "blocks",
                 device: torch.device | str = "cpu",
                 on_step: Callable[[str, int], None] = lambda name, step: None) -> list[HiFTRunResult]:
    """Plain full fine-tuning and HiFT in each of ``orders`` on the same seed and batches, for ``cycles`` full
    HiFT cycles (k steps each; plain fine-tuning takes as many steps). AdamW; a cosine LR decay over the run,
    stepped per step for plain fine-tuning and per cycle for HiFT. Steps are interleaved round-robin; the last
    cycle is profiled for peak memory, the others timed."""
    for name, value, choices in (("compile backend", compile_backend, COMPILE_CHOICES), ("scope", scope, SCOPES)):
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(choices)}")
    bad = [o for o in orders if o not in ORDERS]
    if not orders or bad:
        raise ValueError(f"unknown order {', '.join(map(repr, bad))}; valid orders: {', '.join(ORDERS)}")
    if cycles < 2:
        raise ValueError(f"cycles must be >= 2 (the last one is profiled, not timed); got {cycles}")
    device = torch.device(device)
    torch._dynamo.reset()
    if compile_backend != "none":
        warm_up_compiler()
    hift_runs = [_Run(workload, order, cycles=cycles, lr=lr, layers_per_group=layers_per_group,
                      compile_backend=compile_backend, scope=scope, device=device) for order in orders]
    k = hift_runs[0].result.groups
    runs = [_Run(workload, None, cycles=cycles * k, lr=lr, layers_per_group=layers_per_group,
                 compile_backend=compile_backend, scope=scope, device=device), *hift_runs]
    steps = cycles * k
    for step, index in round_robin(len(runs), steps):
        runs[index].step(profile=step > steps - k)
        on_step(runs[index].result.name, step)
    torch._dynamo.reset()
    return [run.result for run in runs]
