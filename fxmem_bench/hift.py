"""`fxmem bench hift`: plain full fine-tuning against HiFT in each order, side by side on the same batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from fxmem.measure import peak_memory
from fxmem.timing import median, step_times, warm_up_compiler
from fxmem.train.hift import ORDERS, HiFT, optimizer_state_bytes, tensor_bytes
from fxmem_bench.choices import HIFT_COMPILE_CHOICES as COMPILE_CHOICES
from fxmem_bench.choices import HIFT_SCOPES as SCOPES
from fxmem_bench.finetune import round_robin
from fxmem_bench.workloads import Workload

EVAL_BATCHES = 4


@dataclass
class HiFTRunResult:
    name: str
    groups: int  # k; 1 for plain full fine-tuning
    steps: int
    losses: list[float] = field(default_factory=list)
    eval_loss: float = float("nan")  # after the last step, on the held-out batches
    # per step: gradients alive at the optimizer step, optimizer state on the device while it runs, optimizer
    # state held in CPU memory meanwhile
    gradient_bytes: list[int] = field(default_factory=list)
    device_state_bytes: list[int] = field(default_factory=list)
    offloaded_state_bytes: list[int] = field(default_factory=list)
    step_peak_bytes: int = 0  # largest over the last cycle: a step's peak allocation above its start
    seconds: list[float] = field(default_factory=list)
    graphs: int = 0  # graphs dynamo compiled during this run's steps
    eager_fallbacks: int = 0

    @property
    def step_seconds(self) -> float:
        return median(self.seconds[1:] or self.seconds)


class _Run:
    """One training loop, advanced a step at a time, that updates each parameter ``updates`` times: plain full
    fine-tuning in ``updates`` steps, HiFT in ``updates`` cycles of k steps. The LR decays to zero by the last
    update (HiFT steps its scheduler once per cycle). The first ``EVAL_BATCHES`` batches of the stream are held
    out for the final evaluation; every run trains on the same batches after them."""

    def __init__(self, workload: Workload, order: str | None, *, updates: int, lr: float, layers_per_group: int,
                 compile_backend: str, scope: str, device: torch.device, name: str) -> None:
        self.setup = workload.build(device=device, lora_rank=0)
        self.eval_batches = [next(self.setup.batches) for _ in range(EVAL_BATCHES)]
        model = self.setup.model
        self.forward: Callable = model
        if order is None:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
            self.scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(self.optimizer, T_max=updates)
            self.hift = None
            if compile_backend != "none":
                self.forward = torch.compile(model, backend=compile_backend)
        else:
            self.hift = HiFT(model, torch.optim.AdamW, lr=lr, order=order, layers_per_group=layers_per_group,
                             scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=updates))
            if compile_backend != "none" and scope == "blocks":
                self.hift.compile(backend=compile_backend)
            elif compile_backend != "none":
                self.forward = torch.compile(model, backend=compile_backend)
        self.device = device
        groups = 1 if self.hift is None else self.hift.k
        self.result = HiFTRunResult(name, groups, updates * groups)

    @property
    def done(self) -> bool:
        return len(self.result.losses) == self.result.steps

    def step(self) -> None:
        """One optimizer step: timed, but profiled for peak memory over the last cycle (plain: the last step)."""
        graphs_before = counters["stats"]["unique_graphs"]
        if len(self.result.losses) >= self.result.steps - self.result.groups:
            self.result.step_peak_bytes = max(self.result.step_peak_bytes, peak_memory(self._step, self.device))
        else:
            self.result.seconds += step_times(self._step, steps=1, warmup=0, device=self.device)
        self.result.graphs += counters["stats"]["unique_graphs"] - graphs_before
        if self.done:
            with torch.no_grad():
                losses = [self.setup.loss(self.forward, batch).item() for batch in self.eval_batches]
            self.result.eval_loss = sum(losses) / len(losses)

    def _step(self) -> None:
        loss = self.setup.loss(self.forward, next(self.setup.batches))
        loss.backward()
        model, r = self.setup.model, self.result
        r.gradient_bytes.append(tensor_bytes(p.grad for p in model.parameters() if p.grad is not None))
        if self.hift is None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            r.device_state_bytes.append(optimizer_state_bytes(self.optimizer, model.parameters()))
            r.offloaded_state_bytes.append(0)
        else:
            active = self.hift.active.parameters
            self.hift.step()
            r.device_state_bytes.append(optimizer_state_bytes(self.hift.optimizer, active))
            r.offloaded_state_bytes.append(optimizer_state_bytes(self.hift.optimizer, model.parameters())
                                           - r.device_state_bytes[-1])
            r.eager_fallbacks = len(self.hift.eager_fallbacks)
        r.losses.append(loss.item())


def compare_hift(workload: Workload, orders: Sequence[str] = ORDERS, *, cycles: int, lr: float,
                 layers_per_group: int = 1, compile_backend: str = "none", scope: str = "blocks",
                 device: torch.device | str = "cpu",
                 on_step: Callable[[str, int], None] = lambda name, step: None) -> list[HiFTRunResult]:
    """HiFT in each of ``orders`` for ``cycles`` full cycles of k steps, against plain full fine-tuning twice:
    on the same batches (cycles x k steps) and with the same number of updates per parameter (``cycles``
    steps). Same seed and batch stream for all; AdamW with a cosine LR decay to zero over each run; steps
    interleaved round-robin. Returns the two plain runs first, then HiFT's."""
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
    options = {"lr": lr, "layers_per_group": layers_per_group, "compile_backend": compile_backend, "scope": scope,
               "device": device}
    hift_runs = [_Run(workload, order, updates=cycles, name=f"HiFT {order}", **options) for order in orders]
    k = hift_runs[0].result.groups
    runs = [_Run(workload, None, updates=cycles * k, name="full, same batches", **options),
            _Run(workload, None, updates=cycles, name="full, same updates", **options), *hift_runs]
    for step, index in round_robin(len(runs), cycles * k):
        if not runs[index].done:
            runs[index].step()
            on_step(runs[index].result.name, step)
    torch._dynamo.reset()
    return [run.result for run in runs]
