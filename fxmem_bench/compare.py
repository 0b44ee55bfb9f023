"""`fxmem bench compare`: each workload under fxmem and the baselines of docs/methodology.md, in one
process."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from fxmem.backend import Backend, run_eagerly
from fxmem.config import PUBLISHED_MIN_COSINE, Config
from fxmem.measure import (
    Fidelity,
    gradient_fidelity,
    model_tensors,
    peak_memory,
    saved_activation_bytes,
    static_bytes,
    trainable_gradients,
)
from fxmem.timing import interleaved_step_times, median, step_times, warm_up_compiler
from fxmem_bench.choices import COMPARE_METHODS as METHODS
from fxmem_bench.workloads import Setup, Workload

# Each method that runs on CUDA only, and why
CUDA_ONLY_METHODS = {
    "compile-offload": "host offload saves no memory on a CPU",
    "compile-checkpointing-liger": "Liger-Kernel's kernels are Triton GPU kernels",
    "compile-checkpointing-offload": "host offload saves no memory on a CPU",
}
# The methods that take the loss from the decoder's final hidden states, the logits never built whole, and the model
# families whose causal-LM head and loss they reproduce (WORKLOAD_FAMILIES' names, transformers' model_type alike)
HIDDEN_STATE_LOSS_METHODS = frozenset({"compile-checkpointing-lce", "compile-checkpointing-liger"})
HIDDEN_STATE_LOSS_FAMILIES = ("llama",)
IGNORE_INDEX = -100  # HF's label for a token outside the loss
METHOD_DESCRIPTIONS = {
    "eager": "eager PEFT LoRA (what most users run today)",
    "compile": "torch.compile, inductor defaults (min-cut rematerialization)",
    "compile-budget": "inductor with activation_memory_budget (beside it) at the two settings that bracket fxmem's "
                      "measured saved bytes, one saving at most as much and one more (one setting alone where every "
                      "setting saves more, or none more)",
    "hf-checkpointing": "eager with HF gradient checkpointing",
    "compile-checkpointing": "torch.compile over HF gradient checkpointing (each decoder layer recomputed whole)",
    "compile-checkpointing-lce": "compile-checkpointing with the loss taken from the final hidden states by torch's "
                                 "chunked linear_cross_entropy (LinearCrossEntropyOptions), decoder and loss "
                                 "compiled together: the logits never built whole (causal LMs only)",
    "compile-checkpointing-liger": "compile-checkpointing-lce with Liger-Kernel's fused linear cross-entropy in place "
                                   "of torch's (CUDA only, where liger-kernel is installed)",
    "compile-checkpointing-offload": "compile-checkpointing with HF's offloaded checkpointing: each checkpointed "
                                     "layer's inputs held in pinned host memory (CUDA only)",
    "compile-sac": "torch.compile with selective activation checkpointing per decoder layer: matmuls and attention "
                   "saved, everything else recomputed",
    "compile-offload": "torch.compile with inductor's activation offloading: every saved activation it can move "
                       "copied to host memory in forward and back in backward (CUDA only; the saved bytes are "
                       "counted wherever they live)",
    "fxmem": "torch.compile(backend=fxmem) with the chosen preset",
}
# What selective activation checkpointing saves (the matmuls and attention, as torchtitan's op-level policy does);
# everything else, element-wise ops and norms, is recomputed in backward.
SAC_SAVED_OPS = frozenset(op for op in (
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default))


def _sac_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context() -> Any:
    """A checkpoint's context_fn: SAC_SAVED_OPS saved, the rest recomputed."""
    return create_selective_checkpoint_contexts(_sac_policy)


@dataclass
class MethodResult:
    workload: str
    method: str
    saved_bytes: int
    peak_bytes: int  # a full step's peak above its start
    static_bytes: int  # weights, buffers and optimizer state
    compile_seconds: float  # first step minus a warm step (0 for eager methods)
    first_loss: float
    fidelity: Fidelity | None = None  # vs eager, on the first batch
    budget: float | None = None  # activation_memory_budget, for compile-budget
    step_samples: list[float] = field(default_factory=list)
    label: str = ""  # the method as a table shows it, where one method runs in several settings
    fidelity_bound: float | None = None  # the preset's published worst cosine (fxmem points); None: exact

    @property
    def step_seconds(self) -> float:
        return median(self.step_samples)

    @property
    def meets_fidelity_bound(self) -> bool:
        """Exact methods carry 1.0; an fxmem point meets its preset's published worst cosine."""
        return self.fidelity_bound is None or self.fidelity is None or self.fidelity.min_cosine >= self.fidelity_bound

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MethodResult:
        """The result ``to_dict`` wrote (a result file's entry)."""
        return cls(workload=data["workload"], method=data["method"], saved_bytes=data["saved_bytes"],
                   peak_bytes=data["peak_bytes"], static_bytes=data["static_bytes"],
                   compile_seconds=data["compile_seconds"], first_loss=data["first_loss"],
                   fidelity=Fidelity.from_dict(data["fidelity"]) if data.get("fidelity") else None,
                   budget=data.get("budget"), step_samples=list(data["step_samples"]), label=data.get("label", ""),
                   fidelity_bound=data.get("fidelity_bound"))

    def to_dict(self) -> dict[str, Any]:
        return {"workload": self.workload, "method": self.method, "saved_bytes": self.saved_bytes,
                "peak_bytes": self.peak_bytes, "static_bytes": self.static_bytes, "step_seconds": self.step_seconds,
                "step_samples": self.step_samples, "compile_seconds": self.compile_seconds,
                "first_loss": self.first_loss, "budget": self.budget, "label": self.label,
                "fidelity_bound": self.fidelity_bound,
                "fidelity": self.fidelity.to_dict() if self.fidelity else None}


def _budget_backend(budget: float, inner_compile: Callable = compile_fx_inner) -> Callable:
    """Inductor with min-cut at ``budget``; ``inner_compile=run_eagerly``: its pipeline up to its partition
    (decompositions, joint-graph passes, min-cut), the partitioned graphs run as aten ops, without its code
    generation: what inductor saves, sooner."""
    def compile_with_budget(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs, inner_compile=inner_compile)
    return compile_with_budget


def _mark_for_offload(graph: torch.fx.Graph) -> None:
    # inductor offloads the saved activations its joint graph marks; the partitioner keeps to those it can move
    for node in graph.nodes:
        if node.op == "call_function":
            node.meta["should_offload"] = True


def _offloading_backend(on_cuda: bool) -> Callable:
    functorch_config = torch._functorch.config
    if not hasattr(functorch_config, "enable_activation_offloading"):
        raise ValueError(f"compile-offload needs inductor's activation offloading "
                         f"(torch._functorch.config.enable_activation_offloading), absent in torch {torch.__version__}")
    patches = {"enable_activation_offloading": True, "enable_autograd_cache": False}
    if on_cuda and hasattr(functorch_config, "activation_offload_separate_stream"):  # copies overlap compute
        patches["activation_offload_separate_stream"] = True

    def compile_offloading(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        with functorch_config.patch(**patches), torch._inductor.config.patch(joint_custom_pre_pass=_mark_for_offload):
            return compile_fx(gm, example_inputs)
    return compile_offloading


@dataclass
class LossOutput:
    """What the training step reads of a model's output (Setup.loss): the loss alone, no logits."""

    loss: torch.Tensor


HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden, head weight, targets)


def hidden_state_loss(model: torch.nn.Module, head_loss: HeadLoss) -> Callable[..., torch.Tensor]:
    """``model``'s causal-LM loss as HF computes it (the labels shifted by one, padded with IGNORE_INDEX so that the
    last position is ignored; the mean over the tokens not ignored), taken by ``head_loss(hidden, head weight,
    targets)`` from the decoder's final hidden states, [tokens, hidden], so that the logits need not be built whole.
    ``model``: a causal LM, or PEFT's wrapper of one."""
    causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = causal_lm.model, causal_lm.lm_head

    def loss(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
             ) -> torch.Tensor:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        targets = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
        return head_loss(hidden.flatten(0, 1), head.weight, targets.flatten())
    return loss


def _head_loss(method: str) -> HeadLoss:
    if method == "compile-checkpointing-liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger_loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        return lambda hidden, weight, targets: liger_loss(weight, hidden, targets)
    # allow_retain_graph=True is what torch.compile promotes the default to (it keeps the forward's gradient
    # buffers for a second backward); set here, the warning that promotion issues does not break the graph
    # between the decoder and the loss
    options = torch.nn.LinearCrossEntropyOptions(allow_retain_graph=True)
    return lambda hidden, weight, targets: torch.nn.functional.linear_cross_entropy(
        hidden, weight, targets, ignore_index=IGNORE_INDEX, options=options)


def _compiled_hidden_state_loss(method: str, model: torch.nn.Module) -> Callable[..., LossOutput]:
    compiled = torch.compile(hidden_state_loss(model, _head_loss(method)))

    def forward(**batch: torch.Tensor) -> LossOutput:
        return LossOutput(compiled(**batch))
    return forward


def forward_for_method(method: str, model: torch.nn.Module, config: Config, budget: float | None = None
                       ) -> Callable:
    """What the training step calls under ``method``: the model itself, or a compiled wrapper of it (for the
    HIDDEN_STATE_LOSS_METHODS, a compiled loss function that returns a LossOutput)."""
    if method == "eager":
        return model
    if method in HIDDEN_STATE_LOSS_METHODS and (family := model.config.model_type) not in HIDDEN_STATE_LOSS_FAMILIES:
        raise ValueError(_family_refusal(method, family))
    if method in ("hf-checkpointing", "compile-checkpointing", "compile-sac", "compile-checkpointing-offload",
                  *HIDDEN_STATE_LOSS_METHODS):
        # HF's checkpointing of each decoder layer; SAC through the same call (its kwargs go to checkpoint())
        options: dict[str, Any] = {"use_reentrant": False}
        if method == "compile-sac":
            options["context_fn"] = selective_checkpoint_context
        offload = {"offload": True} if method == "compile-checkpointing-offload" else {}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options, **offload)
        if method in HIDDEN_STATE_LOSS_METHODS:
            return _compiled_hidden_state_loss(method, model)
        return model if method == "hf-checkpointing" else torch.compile(model)
    if method == "compile":
        return torch.compile(model)
    if method == "compile-budget":
        return torch.compile(model, backend=_budget_backend(budget))
    if method == "compile-offload":
        on_cuda = next(model.parameters()).device.type == "cuda"
        return torch.compile(model, backend=_offloading_backend(on_cuda))
    if method == "fxmem":
        return torch.compile(model, backend=Backend(config))
    raise ValueError(f"unknown method {method!r}; valid methods: {', '.join(METHODS)}")


def _family_refusal(method: str, family: str) -> str:
    return (f"{method} takes the loss from a causal LM's final hidden states: it supports the "
            f"{', '.join(HIDDEN_STATE_LOSS_FAMILIES)} family only, not {family}")


def unavailable_methods() -> dict[str, str]:
    """The methods whose library is missing or too old here, each with why."""
    import transformers

    missing = {}
    if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
        missing["compile-checkpointing-lce"] = (f"torch {torch.__version__} has no chunked linear_cross_entropy "
                                                "(torch.nn.LinearCrossEntropyOptions)")
    if importlib.util.find_spec("liger_kernel") is None:
        missing["compile-checkpointing-liger"] = "Liger-Kernel is not installed (pip install liger-kernel)"
    enable = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
    if enable is None or "offload" not in inspect.signature(enable).parameters:
        missing["compile-checkpointing-offload"] = (f"transformers {transformers.__version__} has no offloaded "
                                                    "checkpointing (activation_checkpointing_enable(offload=True))")
    return missing


def _on_device(methods: Sequence[str], device: torch.device | str) -> list[str]:
    return [m for m in methods if torch.device(device).type == "cuda" or m not in CUDA_ONLY_METHODS]


def left_out_by_default(methods: Sequence[str], device: torch.device | str, family: str) -> dict[str, str]:
    """Those of ``methods`` that run on ``device`` but not here on ``family``'s workloads, each with why: a model
    family the method does not support, or its library missing."""
    on_device = _on_device(methods, device)
    reasons = {m: _family_refusal(m, family) for m in on_device
               if m in HIDDEN_STATE_LOSS_METHODS and family not in HIDDEN_STATE_LOSS_FAMILIES}
    reasons.update({m: why for m, why in unavailable_methods().items() if m in on_device and m not in reasons})
    return reasons


def default_methods(device: torch.device | str, family: str = "llama", methods: Sequence[str] = METHODS
                    ) -> tuple[str, ...]:
    """Every one of ``methods`` that runs on ``device`` and on ``family``'s workloads (left_out_by_default says why
    the others on ``device`` do not)."""
    left_out = left_out_by_default(methods, device, family)
    return tuple(m for m in _on_device(methods, device) if m not in left_out)


def check_runs_here(methods: Sequence[str], device: torch.device, family: str) -> None:
    """Refuse, with why, the ``methods`` that cannot run on ``device`` or on ``family``'s workloads."""
    if device.type != "cuda" and (cuda_only := [m for m in methods if m in CUDA_ONLY_METHODS]):
        raise ValueError("; ".join(f"{m} runs on CUDA only ({CUDA_ONLY_METHODS[m]})" for m in cuda_only)
                         + f"; got device {device}")
    if family not in HIDDEN_STATE_LOSS_FAMILIES and (refused := [m for m in methods if m in HIDDEN_STATE_LOSS_METHODS]):
        raise ValueError("; ".join(_family_refusal(m, family) for m in refused))
    unavailable = unavailable_methods()
    if missing := [m for m in methods if m in unavailable]:
        raise ValueError("; ".join(f"{m} cannot run: {unavailable[m]}" for m in missing))


def _saved_bytes(workload: Workload, device: torch.device, lora_rank: int,
                 compile_model: Callable[[torch.nn.Module], Callable]) -> int:
    """What ``compile_model``'s method saves for backward on the batch prepare_method measures, measured as
    prepare_method measures it, on a model built for the purpose; dynamo's caches are reset before and after."""
    torch._dynamo.reset()
    setup = workload.build(device=device, lora_rank=lora_rank)
    next(setup.batches)
    batch = next(setup.batches)
    forward = compile_model(setup.model)
    saved, _ = saved_activation_bytes(lambda: setup.loss(forward, batch),
                                      exclude=model_tensors(setup.model) + list(batch.values()))
    torch._dynamo.reset()
    return saved


def inductor_saved_bytes(workload: Workload, device: torch.device, lora_rank: int, budget: float) -> int:
    """Bytes inductor saves for backward at ``budget``, measured as every method's are."""
    return _saved_bytes(workload, device, lora_rank,
                        lambda model: torch.compile(model, backend=_budget_backend(budget, run_eagerly)))


@dataclass(frozen=True)
class BudgetBracket:
    """The activation_memory_budget settings on either side of a target in saved bytes (None: no such setting)."""

    below: float | None  # the largest setting found whose bytes are at most the target
    above: float | None  # the smallest setting found whose bytes exceed it

    @property
    def budgets(self) -> tuple[float, ...]:
        return tuple(b for b in (self.below, self.above) if b is not None)


def budget_bracket(workload: Workload, target_bytes: int, device: torch.device, lora_rank: int,
                   iterations: int = 7) -> BudgetBracket:
    """Bisect activation_memory_budget for the two settings whose inductor-saved bytes bracket ``target_bytes``."""
    def fits(budget: float) -> bool:
        return inductor_saved_bytes(workload, device, lora_rank, budget) <= target_bytes

    if fits(1.0):
        return BudgetBracket(below=1.0, above=None)
    if not fits(0.0):
        return BudgetBracket(below=None, above=0.0)
    low, high = 0.0, 1.0
    for _ in range(iterations):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return BudgetBracket(below=low, above=high)


@dataclass
class _Prepared:
    result: MethodResult
    grads: dict[str, torch.Tensor]
    step: Callable[[], None]


def prepare_method(workload: Workload, method: str, *, config: Config, device: torch.device, lora_rank: int,
                   budget: float | None, reference_grads: dict[str, torch.Tensor] | None, label: str = "") -> _Prepared:
    """Build and compile one method, and measure everything but its step time."""
    setup: Setup = workload.build(device=device, lora_rank=lora_rank)
    forward = forward_for_method(method, setup.model, config, budget)
    first_batch, batch = next(setup.batches), next(setup.batches)
    step, optimizer = setup.training_step(forward, batch)
    first_losses: list[float] = []

    def first_batch_backward() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = setup.loss(forward, first_batch)
        loss.backward()
        first_losses.append(loss.item())

    # The first batch twice at the initial weights: its gradients (fidelity), and cold minus warm (compile time).
    cold, warm = (step_times(first_batch_backward, steps=1, warmup=0, device=device)[0] for _ in range(2))
    grads = trainable_gradients(setup.model)
    optimizer.zero_grad(set_to_none=True)
    saved, loss = saved_activation_bytes(lambda: setup.loss(forward, batch),
                                         exclude=model_tensors(setup.model) + list(batch.values()))
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    step()  # creates the optimizer state, so that the peak below is a steady step's
    result = MethodResult(
        workload=workload.name, method=method, saved_bytes=saved, peak_bytes=peak_memory(step, device),
        static_bytes=static_bytes(setup.model, optimizer), compile_seconds=max(cold - warm, 0.0),
        first_loss=first_losses[0], budget=budget, label=label or method,
        fidelity=gradient_fidelity(reference_grads, grads) if reference_grads is not None else None)
    return _Prepared(result=result, grads=grads, step=step)


def run_workload(workload: Workload, *, preset: str = "exact", device: torch.device | str = "cpu", steps: int = 5,
                 lora_rank: int = 16, methods: Sequence[str] | None = None, return_logits: bool = True,
                 options: Mapping[str, Any] | None = None,
                 progress: Callable[[str], None] = lambda message: None) -> list[MethodResult]:
    """Every method on one workload, all kept alive so that their steps are timed interleaved.

    Fidelity is measured against eager's gradients on the same batch and weights. ``methods``: default, every
    method that runs on ``device``. compile-budget runs at the two budgets that bracket fxmem's measured saved
    bytes (measured first, on a model of their own; without fxmem among the methods, compile-budget is refused).
    ``return_logits=False``: fxmem returns no logits (Config.return_logits), so it chunks the loss; the step reads
    only the loss. ``options``: further Config overrides of the preset.
    """
    device = torch.device(device)
    methods = default_methods(device, workload.family) if methods is None else tuple(methods)
    _check_methods(methods, device, workload.family)
    config = Config.from_preset(preset, **{"return_logits": return_logits, **(options or {})})
    bracket = None
    if "compile-budget" in methods:  # first: each probe resets dynamo, which would recompile a prepared method
        progress(f"{workload.name}: fxmem's saved bytes, and the activation_memory_budget settings around them")
        target = _saved_bytes(workload, device, lora_rank, lambda model: forward_for_method("fxmem", model, config))
        bracket = budget_bracket(workload, target, device, lora_rank)
    torch._dynamo.reset()
    warm_up_compiler()
    prepared: dict[str, _Prepared] = {}
    reference = None

    def prepare(method: str, budget: float | None = None) -> _Prepared:
        label = method if budget is None else f"{method} {budget:.3f}"
        progress(f"{workload.name}: {label}")
        prepared[label] = prepare_method(workload, method, config=config, device=device, lora_rank=lora_rank,
                                         budget=budget, reference_grads=reference, label=label)
        return prepared[label]

    # Every method compiles cold: a cache warmed by an earlier run (or method) would make compile times incomparable.
    with torch.compiler.config.patch(force_disable_caches=True):
        for method in sorted(methods, key=lambda m: m != "eager"):  # eager first: the fidelity reference
            if method == "compile-budget":
                for budget in bracket.budgets:
                    prepare(method, budget)
                continue
            done = prepare(method)
            if method == "eager":
                reference = done.grads
            elif method == "fxmem":
                done.result.fidelity_bound = PUBLISHED_MIN_COSINE.get(preset)
    progress(f"{workload.name}: timing {steps} interleaved steps")
    time_interleaved(prepared, steps=steps, device=device)
    torch._dynamo.reset()
    order = {method: i for i, method in enumerate(METHODS)}
    return sorted((p.result for p in prepared.values()), key=lambda r: (order[r.method], r.budget or 0.0))


def _check_methods(methods: Sequence[str], device: torch.device, family: str) -> None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid methods: {', '.join(METHODS)}")
    check_runs_here(methods, device, family)
    if "compile-budget" in methods and "fxmem" not in methods:
        raise ValueError("compile-budget is matched to fxmem's measured saved bytes: add fxmem to the methods")


def time_interleaved(prepared: dict[str, _Prepared], *, steps: int, device: torch.device) -> list[MethodResult]:
    """Every prepared method's steps, timed interleaved (one warm-up round); their results with the samples."""
    samples = interleaved_step_times({name: p.step for name, p in prepared.items()}, steps=steps, warmup=1,
                                     device=device)
    for name, p in prepared.items():
        p.result.step_samples = samples[name]
    return [p.result for p in prepared.values()]
