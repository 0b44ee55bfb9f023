"""`fxmem bench lowrank-saved`: saved-activation bytes and gradient fidelity of LoRAct per rank ratio, vs eager
PEFT LoRA.

One batch of the workload at its initial (seeded) weights: eager PEFT runs it
first (the reference bytes and gradients), then fxmem at each ratio, compiled
afresh. Bytes are measured on the tensors autograd actually holds
(``measure.saved_activation_bytes``: unique storages, parameters and inputs
excluded) and compared with the plan's bytes (the cost model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.cost_model.plan import Action
from fxmem.measure import Fidelity, gradient_fidelity, model_tensors, saved_bytes_and_gradients
from fxmem_bench.workloads import Workload


@dataclass(frozen=True)
class RatioResult:
    setting: str  # "eager PEFT" or the lowrank value
    saved_bytes: int
    planned_bytes: int | None  # fxmem's report; None for eager
    fidelity: Fidelity | None  # None for eager (the reference)
    prenorm_shared: int  # norm inputs rebuilt from their output's factors


def measure_ratios(workload: Workload, ratios: Sequence[float | int], *, lora_rank: int = 16,
                   lowering: str = "inductor") -> list[RatioResult]:
    """Eager PEFT's saved bytes and gradients on one batch, then fxmem's at each ``lowrank`` value in ``ratios``."""
    setup = workload.build(lora_rank=lora_rank)
    batch = next(setup.batches)
    exclude = model_tensors(setup.model) + list(batch.values())

    def run(forward) -> tuple[int, dict[str, torch.Tensor]]:
        torch.manual_seed(0)  # the same row samples at every ratio
        return saved_bytes_and_gradients(setup.model, lambda: setup.loss(forward, batch), exclude)

    saved, reference = run(setup.model)
    results = [RatioResult("eager PEFT", saved, None, None, 0)]
    for ratio in ratios:
        torch._dynamo.reset()
        backend = Backend(Config(lowrank=ratio), lowering=lowering)
        saved, grads = run(torch.compile(setup.model, backend=backend))
        report = backend.report()
        shared = sum(1 for _, s, p in report.rows() if p.action is Action.PRENORM and s.nbytes > 0)
        results.append(RatioResult(str(ratio), saved, report.planned_bytes, gradient_fidelity(reference, grads),
                                   shared))
    torch._dynamo.reset()
    return results
