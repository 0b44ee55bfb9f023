"""`fxmem bench recipes`: the recipes people run (issue 46), each preset against torch.compile on the same recipe.

A recipe changes how the workload trains, not its model's shape:

- ``plain``: the workload as it is (one batch, its dtype, LoRA dropout 0);
- ``dropout``: PEFT's ``lora_dropout=0.05``, the QLoRA scripts' and most TRL examples' default;
- ``autocast``: the fp32 model's forward under ``torch.autocast`` in bf16, as ``Trainer(bf16=True)`` runs one;
- ``packed``: the batch's rows cut into documents and flattened into one row whose ``position_ids`` restart at each
  document, as TRL's ``padding_free`` and transformers' ``DataCollatorWithFlattening`` make them (each document's
  first label -100);
- ``accumulation``: four micro-batches, each loss divided by four, one backward each, the gradients summed;
- ``qlora``: the base an NF4 bitsandbytes model loaded and prepared with peft's defaults (``prepare_model_for_kbit_
  training``), the adapters on top.

Each method runs the recipe from the same weights and seed (so the same dropout masks: inductor draws them from the
step's seed) and its trainable gradients are compared with torch.compile's on the same recipe. Saved bytes are
fxmem's own: what its report plans to hold, against what torch.compile holds; a fallback is any
``fxmem.FallbackWarning`` the run raised (strict mode off, so that the matrix shows them instead of stopping).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fxmem.config import PRESETS, Config
from fxmem.fallback import FallbackError, FallbackWarning
from fxmem.measure import gradient_fidelity
from fxmem_bench.choices import RECIPES
from fxmem_bench.workloads import Setup, Workload

RECIPE_DROPOUT = 0.05
MICRO_BATCHES = 4
_SEED = 3  # torch's global seed before each run: inductor's dropout seeds, so the same masks in every method


@dataclass(frozen=True)
class RecipeResult:
    recipe: str
    method: str  # an fxmem preset
    saved_bytes: int  # what torch.compile saves for backward (fxmem's report, before its rewrites)
    planned_bytes: int  # what fxmem's plan saves
    min_cosine: float  # worst trainable gradient against torch.compile's on the same recipe
    worst_parameter: str
    compared: int  # gradients compared, none of them zero in the reference (gradient_fidelity refuses those)
    max_relative_error: float  # the largest relative L2 error of any trainable gradient
    fallbacks: tuple[str, ...]  # the FallbackWarnings the run raised

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build(workload: Workload, recipe: str, device: torch.device | str = "cpu") -> Setup:
    """The workload built for ``recipe``: its model (an NF4 base for qlora, fp32 for autocast, LoRA dropout for
    dropout), with the workload's own batches."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; valid recipes: {', '.join(RECIPES)}")
    if workload.family != "llama" or workload.pretrained:
        raise ValueError(f"recipes run on the random-weight llama workloads; got {workload.name}")
    workload = dataclasses.replace(workload, nf4=recipe == "qlora")
    dtype = torch.float32 if recipe == "autocast" else None
    return workload.build(device=device, dtype=dtype, lora_dropout=RECIPE_DROPOUT if recipe == "dropout" else 0.0)


def batches(setup: Setup, recipe: str) -> list[dict[str, torch.Tensor]]:
    """The batches one step of ``recipe`` runs: four for accumulation, one packed row for packed, else one."""
    if recipe == "accumulation":
        return [next(setup.batches) for _ in range(MICRO_BATCHES)]
    batch = next(setup.batches)
    return [packed(batch["input_ids"]) if recipe == "packed" else batch]


def packed(rows: torch.Tensor, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` ([batch, seq] token ids) as documents flattened into one row: each row cut at seeded points into
    documents of 1/8 to 1/2 of its length, ``position_ids`` restarting at each, each document's first label -100."""
    generator = torch.Generator().manual_seed(seed)
    seq = rows.shape[1]
    positions, labels = [], rows.clone()
    for row in range(rows.shape[0]):
        start = 0
        while start < seq:
            length = min(seq - start, int(torch.randint(seq // 8, seq // 2 + 1, (), generator=generator)))
            positions.append(torch.arange(length))
            labels[row, start] = -100
            start += length
    return {"input_ids": rows.reshape(1, -1), "labels": labels.reshape(1, -1),
            "position_ids": torch.cat(positions).to(rows.device).unsqueeze(0)}


def run_step(setup: Setup, forward: Callable[..., Any], recipe: str,
             step_batches: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One training step of ``recipe`` through ``forward`` (no optimizer step): the trainable gradients it leaves."""
    model = setup.model
    model.zero_grad(set_to_none=True)
    torch.manual_seed(_SEED)
    for batch in step_batches:
        with torch.autocast(next(model.parameters()).device.type, dtype=torch.bfloat16, enabled=recipe == "autocast"):
            loss = setup.loss(forward, batch)
        (loss / len(step_batches)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def measure(workload: Workload, recipes: Sequence[str], presets: Sequence[str], *, device: torch.device | str = "cpu",
            options: dict[str, Any] | None = None,
            on_result: Callable[[RecipeResult], None] = lambda result: None) -> list[RecipeResult]:
    """Each preset on each recipe, against torch.compile on the same recipe."""
    for preset in presets:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    results = []
    for recipe in recipes:
        setup = build(workload, recipe, device)
        step_batches = batches(setup, recipe)
        torch._dynamo.reset()
        reference = run_step(setup, torch.compile(setup.model), recipe, step_batches)
        for preset in presets:
            backend, grads, fallbacks = _run_preset(setup, recipe, step_batches, preset, options or {})
            report = backend.report()
            fidelity = gradient_fidelity(reference, grads)
            errors = [(grads[n].double() - r.double()).norm().item() / max(r.double().norm().item(), 1e-30)
                      for n, r in reference.items()]
            result = RecipeResult(recipe=recipe, method=preset, saved_bytes=report.activation_bytes,
                                  planned_bytes=report.planned_bytes, min_cosine=fidelity.min_cosine,
                                  worst_parameter=fidelity.worst_parameter, compared=fidelity.compared,
                                  max_relative_error=max(errors),
                                  fallbacks=fallbacks)
            on_result(result)
            results.append(result)
        del setup
    return results


def _run_preset(setup: Setup, recipe: str, step_batches: Sequence[dict[str, torch.Tensor]], preset: str,
                options: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], tuple[str, ...]]:
    """The preset's backend and gradients, and what fell back: run in strict mode first, since an unsupported
    pattern otherwise shows only in the report; where strict mode raises, its error is recorded and the recipe run
    again without it (FXMEM_STRICT=1 stops there instead), with the warnings that run raises."""
    from fxmem.backend import Backend

    def attempt(strict: bool) -> tuple[Backend, dict[str, torch.Tensor], list[str]]:
        torch._dynamo.reset()
        backend = Backend(Config.from_preset(preset, strict=strict, **options))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FallbackWarning)
            grads = run_step(setup, torch.compile(setup.model, backend=backend), recipe, step_batches)
        return backend, grads, [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]

    try:
        backend, grads, _ = attempt(strict=True)
        return backend, grads, ()
    except FallbackError as error:
        raised = str(error).split(" [strict mode")[0]
    backend, grads, warned = attempt(strict=False)
    return backend, grads, tuple(dict.fromkeys([raised, *warned]))
