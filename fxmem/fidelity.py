"""``fxmem.check_fidelity``: how far a preset bends a model's gradients on one batch, and which saved tensor does it.

The batch runs once exactly (the model as it is, eagerly) and once under the preset, and every trainable
gradient is compared: cosine similarity and relative L2 error. The compressed run compiles with fidelity probes
(fxmem.kernels.probe): each compressed saved tensor is also saved exactly, and backward reads one or the other
through a switch. Switching one tensor at a time to its compressed form, the rest exact, measures what that tensor
alone does to the gradients, with one compilation. The per-parameter figures are those of every tensor
compressed, the plan a training run gets.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from rich.console import Console, Group, RenderableType
from rich.table import Table

from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.cost_model.plan import Action, Plan
from fxmem.kernels import probe as probe_kernel
from fxmem.measure import cosine_and_error, gradient_fidelity, trainable_gradients
from fxmem.peft_lora import prepared_for


@dataclass(frozen=True)
class ParameterFidelity:
    name: str
    cosine: float
    relative_error: float


@dataclass(frozen=True)
class TensorFidelity:
    """What one compressed saved tensor alone (every other exact) does to the gradients."""

    region: int
    tensor: str
    role: str
    layer: str
    plan: str
    min_cosine: float
    worst_parameter: str
    median_relative_error: float


@dataclass(frozen=True)
class FidelityReport:
    preset: str
    config: Config
    parameters: list[ParameterFidelity]  # worst cosine first
    tensors: list[TensorFidelity]  # worst first; empty when nothing is compressed or per_tensor=False
    # zero in the exact run, so nothing to compare: LoRA A while B is zero, as PEFT initialises it
    zero_gradients: list[str]

    @property
    def min_cosine(self) -> float:
        return min((p.cosine for p in self.parameters), default=1.0)

    @property
    def worst_parameter(self) -> str:
        return self.parameters[0].name if self.parameters else ""

    def to_dict(self) -> dict[str, Any]:
        return {"preset": self.preset, "config": self.config.to_dict(), "min_cosine": self.min_cosine,
                "parameters": [vars(p) for p in self.parameters], "tensors": [vars(t) for t in self.tensors],
                "zero_gradients": self.zero_gradients}

    def renderables(self, top: int = 10) -> list[RenderableType]:
        parameters = Table(title=f"Gradients under {self.preset} against eager, worst first", title_justify="left")
        for column in ("parameter", "cosine", "relative error"):
            parameters.add_column(column, justify="left" if column == "parameter" else "right")
        for p in self.parameters[:top]:
            parameters.add_row(short_name(p.name), f"{p.cosine:.4f}", f"{p.relative_error:.4f}")
        parts: list[RenderableType] = [parameters]
        if self.tensors:
            tensors = Table(title="Each compressed tensor alone (the rest exact), worst first", title_justify="left")
            for column in ("region", "tensor", "role", "layer", "plan", "min cosine", "worst parameter",
                           "median error"):
                tensors.add_column(column, justify="right" if column in ("min cosine", "median error") else "left")
            for t in self.tensors[:top]:
                tensors.add_row(str(t.region), t.tensor, t.role, short_name(t.layer), t.plan, f"{t.min_cosine:.4f}",
                                short_name(t.worst_parameter), f"{t.median_relative_error:.4f}")
            parts.append(tensors)
        parts.append(f"{len(self.parameters)} trainable parameters compared, min cosine {self.min_cosine:.4f} "
                     f"({short_name(self.worst_parameter)}); {len(self.tensors)} compressed tensors probed")
        if self.zero_gradients:
            parts.append(f"{len(self.zero_gradients)} parameters not compared, their exact gradient is zero (e.g. "
                         f"{short_name(self.zero_gradients[0])}): LoRA A has none while B is at its zero init; "
                         "check a model trained a few steps, or with B drawn")
        return parts

    def table(self, width: int = 160, top: int = 10) -> str:
        console = Console(file=io.StringIO(), width=width, color_system=None)
        console.print(Group(*self.renderables(top)))
        return console.file.getvalue()


def check_fidelity(model: torch.nn.Module, batch: Mapping[str, Any], preset: str = "hyclora-4bit", *,
                   loss: Callable[[Any], torch.Tensor] | None = None, lowering: str = "eager",
                   per_tensor: bool = True, **overrides: Any) -> FidelityReport:
    """Run ``batch`` through ``model`` eagerly and under fxmem's ``preset`` (with ``overrides``), and compare every
    trainable gradient; with ``per_tensor``, also each compressed saved tensor's effect alone.

    ``loss`` maps the model's output to the scalar to differentiate (default: its ``loss``, as HF models return
    when the batch has labels). ``lowering="eager"`` runs fxmem's rewritten graphs without code generation (the
    same numbers in fp32, seconds to compile); "inductor" measures the generated code (the CUDA-only Triton
    kernels of ``fused_epilogue`` run only then). ``model`` is the plain module, not one already compiled. The
    model's gradients are left cleared; dynamo's caches are reset, before and after; the global RNG is seeded
    (``torch.manual_seed(0)``) before each run, so that random low-rank sketches draw the same in each.
    Parameters whose exact gradient is zero are listed apart (``zero_gradients``), not compared. The reference is
    the model as given; PEFT's LoRA on routers and experts is then prepared as ``fxmem.compile_`` prepares it
    (``fxmem.prepare_peft``, in place; the experts' chunks set before are restored after), so its rounding is
    part of what is compared.
    """
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or model._compiled_call_impl is not None:
        raise ValueError("check_fidelity needs the model itself, not a compiled one (torch.compile(model) or "
                         "model.compile()): its exact run would go through the compiled code")
    config = Config.from_preset(preset, **overrides)
    loss = loss or output_loss
    torch._dynamo.reset()
    reference = _gradients(model, lambda: loss(model(**batch)))
    with prepared_for(model, config):
        zero = [name for name, gradient in reference.items() if not gradient.any()]
        compared = {name: gradient for name, gradient in reference.items() if name not in zero}
        backend = Backend(config, lowering=lowering, fidelity_probes=per_tensor)
        compiled = torch.compile(model, backend=backend)
        try:
            compressed = _gradients(model, lambda: loss(compiled(**batch)))
            probes = [(region, probe, name) for region in backend.regions for probe, name in region.probes]
            tensors = []
            for region, probe, name in probes:
                for other in probes:
                    probe_kernel.COMPRESSED[other[1]] = other[1] == probe
                alone = gradient_fidelity(compared, _gradients(model, lambda: loss(compiled(**batch))))
                saved, plan = _saved_and_plan(region, name)
                tensors.append(TensorFidelity(region.index, name, saved.role.value, saved.layer, describe_plan(plan),
                                              alone.min_cosine, alone.worst_parameter, alone.median_relative_error))
        finally:
            probe_kernel.release([probe for region in backend.regions for probe, _ in region.probes])
            torch._dynamo.reset()
    parameters = [ParameterFidelity(name, *cosine_and_error(gradient, compressed[name]))
                  for name, gradient in compared.items()]
    return FidelityReport(preset, config, sorted(parameters, key=lambda p: p.cosine),
                          sorted(tensors, key=lambda t: t.min_cosine), zero)


def short_name(name: str) -> str:
    """A parameter or module path without PEFT's wrapping: 'layers.0.self_attn.o_proj.lora_A'."""
    return name.removeprefix("base_model.model.").removeprefix("model.").removesuffix(".default.weight")


def output_loss(output: Any) -> torch.Tensor:
    value = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if not isinstance(value, torch.Tensor):
        raise TypeError("the model's output has no loss: pass labels in the batch, or loss=<a function of the "
                         "model's output that returns the scalar to differentiate>")
    return value


def _gradients(model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # a random decomposition (low-rank factors) draws the same in every run
    loss().backward()
    grads = trainable_gradients(model)
    model.zero_grad(set_to_none=True)
    if not grads:
        raise ValueError("the model has no trainable parameters: nothing to compare")
    return grads


def _saved_and_plan(region: Any, name: str) -> tuple[Any, Plan]:
    for saved, plan in zip(region.saved, region.plans, strict=True):
        if saved.name == name:
            return saved, plan
    raise RuntimeError(f"fidelity probe on {name!r}, which region {region.index}'s plan does not list")


def describe_plan(plan: Plan) -> str:
    """The plan in a few words: what the tensor is stored as."""
    if plan.action is Action.QUANTIZE:
        extras = [f"{plan.outliers} outlier channels" if plan.outliers else "",
                  f"1 exact value per {plan.chunk}" if plan.chunk else ""]
        return ", ".join([f"{plan.bits}-bit codes", *filter(None, extras)])
    if plan.action is Action.LOWRANK:
        return f"rank-{plan.rank} factors"
    if plan.action is Action.PRENORM:
        source = f"{plan.bits}-bit codes" if plan.bits else f"rank-{plan.rank} factors"
        return f"rebuilt from its norm output's {source}"
    if plan.action is Action.SPARSIFY:
        return f"{plan.kept_per_row} values per row"
    return {Action.KEEP: "exact", Action.RECOMPUTE: "recomputed in backward"}.get(plan.action, plan.action.value)
