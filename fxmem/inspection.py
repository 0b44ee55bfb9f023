"""fxmem.inspect: what a model saves for backward and what the config would do to it."""

from __future__ import annotations

from typing import Any

import torch

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.guard import check_plan
from fxmem.passes import PassManager
from fxmem.peft_lora import prepared_for
from fxmem.report import Report
from fxmem.techniques import default_passes


def inspect(model: torch.nn.Module, *example_args: Any, config: Config | None = None, guard: bool = True,
            **example_kwargs: Any) -> Report:
    """Trace ``model`` on the example inputs as fxmem's backend would and report every saved tensor.

    The graphs go through the same dynamo, AOTAutograd, decomposition and
    partition steps as a real compile, but run as plain aten graphs instead of
    generated code, so this takes seconds. One forward runs (with grad enabled);
    no backward and no optimizer step. The model's train/eval mode is respected; PEFT's LoRA on routers and
    experts is prepared as ``fxmem.compile_`` prepares it (``fxmem.prepare_peft``, in place; the experts' chunks
    set before are restored after). Passes that only pick
    which kernel runs a product (and would time candidates to do it) are left out: they save nothing. With
    ``config.guard`` (the lossy presets), a model in training mode and a batch with labels, the guard checks the
    plan on the example batch first (fxmem/guard.py): the report lists what it demoted and the cosines before and
    after, and the plan shown is the mended one; ``guard=False`` shows the planner's plan alone (as ``fxmem whatif``
    does, whose inputs hold no data to check).
    """
    config = config or Config()
    passes = PassManager([p for p in default_passes() if not p.speed_only])
    backend = Backend(config, lowering="eager", passes=passes)
    if guard and config.guard and config.compresses and model.training and not example_args \
            and "labels" in example_kwargs:
        backend.guard_checks.append(check_plan(model, example_kwargs, config, backend.demotions))
    compiled = torch.compile(model, backend=backend)
    with prepared_for(model, config), torch.enable_grad():
        compiled(*example_args, **example_kwargs)
    if not backend.regions:
        raise RuntimeError(
            "dynamo compiled nothing for this model, so there is nothing to inspect: it probably hit "
            "torch._dynamo.config.recompile_limit for this model class and fell back to eager. "
            "Call torch._dynamo.reset() before fxmem.inspect.")
    return backend.report()
