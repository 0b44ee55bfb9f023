"""What a LoRA fine-tune of a model would cost, per preset, before launching it: no GPU, no weights.

The model is built from its config on fake tensors of the CPU (no storage, no
compute, a real CPU run's dispatch) and traced by fxmem's own backend (the same
dynamo, AOTAutograd, partition and analysis as a real run), so the
saved-activation bytes are the analysis's, with each preset's plans priced by
the cost model. A deep model is traced at a few depths and scaled by its layer
count when its blocks save alike. Weights, gradients and optimizer state are
counted from the parameters; the LoRA order per layer shape comes from the
FLOPs chooser.
"""

from __future__ import annotations

import copy
import pathlib
import re
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fxmem.choices import BASES, CONTEXT_GRANULARITY, DTYPE_NAMES, MAX_CONTEXT_PRESETS, OPTIMIZER_STATES
from fxmem.config import Config, overrides_text
from fxmem.cost_model.lora_orders import LoraShape, OrderChoice, choose_by_flops, choose_for_experts
from fxmem.cost_model.loss import LossChunks, chunked_loss_bytes, loss_chunks, unfused_loss_bytes
from fxmem.fallback import FallbackError, FallbackWarning
from fxmem.fitting import Probe, longest_fitting
from fxmem.kernels.nf4 import nf4_nbytes
from fxmem.models import build_lora_model, example_batch, hf_config, is_causal_lm

# Traced on fake tensors of this device, not on meta tensors: on meta, SDPA takes its math path and saves the
# attention probabilities, where a real CPU (or GPU) run takes a fused kernel that saves only its output and
# log-sum-exp, and min-cut's choices follow from that.
TRACE_DEVICE = "cpu"
# Block counts traced for a deeper model. Not from 1: the first block's input needs no gradient, so it may save
# differently from the others.
SCALING_DEPTHS = (2, 3, 4)
MAX_SCALING_DEPTH = 6  # beyond it, a model whose blocks do not save alike is traced whole
DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class TraceNote:
    """What fxmem said of a traced step beside its figures, which the prediction then follows: a fallback (a pass's
    stage rolled back, a region compiled unplanned, ...: fxmem.fallback) or a region's note (Region.notes)."""

    text: str  # without the region's index
    regions: int  # how many regions of one trace met it; 0: outside any region (the chunked loss's blocks)
    fallback: bool  # a FallbackWarning: fxmem did otherwise than the preset asks there

    def describe(self) -> str:
        where = f"{self.regions} region{'s' if self.regions > 1 else ''}" if self.regions else "outside any region"
        return f"{'fell back: ' if self.fallback else ''}{self.text} ({where})"


@dataclass(frozen=True)
class PresetCost:
    preset: str
    weights: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    how: str = ""  # how the saved activations were found: the whole model traced, or a few layers scaled
    notes: tuple[TraceNote, ...] = ()  # every trace's fallbacks and region notes, each once

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.saved_activations

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class LoraOrder:
    """A row of the LoRA order table: a LoRA problem, how many layers have it, and the order the FLOPs chooser picks.

    ``experts`` > 1: each of those layers is a mixture of experts' stacked weight, which PEFT adapts with one LoRA
    of rank r per expert (``ParamWrapper``); ``shape`` is one expert's LoRA at its share of the tokens."""

    shape: LoraShape
    layers: int  # layers (modules) with this shape
    choice: OrderChoice
    experts: int = 1  # LoRAs per layer

    @property
    def loras(self) -> int:
        """How many LoRAs of this shape the model has."""
        return self.layers * self.experts


@dataclass
class WhatIf:
    model: str
    batch: int
    seq: int
    rank: int
    dtype: torch.dtype
    optimizer: str
    adapter_dtype: torch.dtype  # PEFT keeps a bf16/fp16 model's adapters in fp32 (autocast_adapter_dtype)
    costs: list[PresetCost] = field(default_factory=list)
    lora_orders: list[LoraOrder] = field(default_factory=list)
    loss: LossCost | None = None  # a causal LM's loss; None for an encoder

    @property
    def notes(self) -> list[tuple[str, TraceNote]]:
        """Every preset's fallbacks and region notes, with the preset."""
        return [(cost.preset, note) for cost in self.costs for note in cost.notes]


@dataclass(frozen=True)
class LossCost:
    """The LM loss at its peak (cost_model/loss.py): unfused with the logits returned, and chunked."""

    tokens: int
    vocab: int
    unfused: int
    chunked: int
    chunks: LossChunks


def fake_lora_model(config: Any, rank: int, dtype: torch.dtype, fake_mode: FakeTensorMode) -> torch.nn.Module:
    """``build_lora_model``'s model with every parameter and buffer a FakeTensor on ``TRACE_DEVICE``: no storage and
    no compute, but the dispatch of a real run there (a tensor shared by two modules stays shared)."""
    model = build_lora_model(config, rank, dtype)
    fakes: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            with fake_mode:
                empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=TRACE_DEVICE)
            fakes[id(tensor)] = (torch.nn.Parameter(empty, requires_grad=tensor.requires_grad)
                                 if isinstance(tensor, torch.nn.Parameter) else empty)
        return fakes[id(tensor)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensors[name] = fake(tensor)
    return model


@dataclass(frozen=True)
class ActivationBytes:
    saved: int  # what the step saves between forward and backward, as planned
    transient: int  # beside those, the most its graphs hold at once as inductor runs them
    # (Region.compiled_transient_bytes): backward's gradients and intermediates at its peak net of the saved
    # activations it freed by then, or forward's transients
    host: int = 0  # what the step stores in host memory instead (block_offload): in neither of the above
    notes: tuple[TraceNote, ...] = ()  # the trace's fallbacks and region notes
    # the two sides of ``transient``, which grow unlike with depth (forward's: one block's; backward's: every
    # block's LoRA gradients at its peak), so scaled apart; ``transient`` is the larger
    forward_transient: int = 0
    backward_peak: int = 0

    @property
    def step(self) -> int:
        """The step's peak above the static bytes (weights, optimizer state), as ``max_context`` counts it: the
        saved activations and, beside them, the transients."""
        return self.saved + self.transient


def predicted_activation_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor], config: Config
                               ) -> ActivationBytes:
    """Saved-activation bytes of one step under ``config`` (the analysis's tensors priced by the cost model), and
    its transients (analysis.liveness.compiled_liveness: the graphs run in their own order with element-wise ops
    inside their readers' kernels and backward freeing each saved activation after its last reader, as inductor
    runs them), with every fallback and region note the trace met. In strict mode (``config.strict``,
    FXMEM_STRICT=1) a fallback raises FallbackError instead."""
    from fxmem.inspection import inspect
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")  # transformers' and torch's deprecations: not the prediction's
        warnings.simplefilter("always", FallbackWarning)  # each region's, not once per call site
        try:
            report = inspect(model, config=config, guard=False, **batch)
        except Exception as error:
            fallback = _fallback_error(error)
            if fallback is None:
                raise
            raise fallback from None  # strict mode's error, not dynamo's wrapper around it
    from fxmem.cost_model.memory import host_bytes
    return ActivationBytes(saved=sum(planned for _, saved, planned in _activation_rows(report)),
                           transient=max((r.compiled_transient_bytes for r in report.regions), default=0),
                           forward_transient=max((fw.transient_bytes for r in report.regions
                                                  for fw, _ in r.compiled_liveness), default=0),
                           backward_peak=max((bw.peak_bytes for r in report.regions
                                              for _, bw in r.compiled_liveness), default=0),
                           host=sum(host_bytes(s, p) for _, s, p in report.rows() if s.frees_memory),
                           notes=_trace_notes(report, [str(w.message) for w in caught
                                                       if issubclass(w.category, FallbackWarning)]))


def _fallback_error(error: BaseException | None) -> FallbackError | None:
    """The FallbackError ``error`` is or was raised from (dynamo wraps a backend's errors), if any."""
    while error is not None and not isinstance(error, FallbackError):
        error = error.__cause__ or error.__context__
    return error


# fxmem's fallback warnings name the region they happened in: "fxmem region 3: ..."
_REGION_PREFIX = re.compile(r"fxmem region (\d+): ")


def _trace_notes(report: Any, fallbacks: list[str]) -> tuple[TraceNote, ...]:
    """The fallback warnings and region notes of one trace, each text once with the regions that met it. A region
    compiled unplanned both warns and notes it: one fallback."""
    regions: dict[str, set[int]] = {}
    for message in fallbacks:
        match = _REGION_PREFIX.match(message)
        regions.setdefault(message[match.end():] if match else message, set()).update(
            {int(match[1])} if match else set())
    fell_back = set(regions)
    for region in report.regions:
        for note in region.notes:
            regions.setdefault(note, set()).add(region.index)
    return tuple(TraceNote(text, len(indices), text in fell_back) for text, indices in regions.items())


def _merged_notes(*groups: tuple[TraceNote, ...]) -> tuple[TraceNote, ...]:
    """The notes of several traces of one preset (depths, lengths), each text once, with the most regions any trace
    met it in."""
    merged: dict[tuple[str, bool], int] = {}
    for notes in groups:
        for note in notes:
            key = (note.text, note.fallback)
            merged[key] = max(merged.get(key, 0), note.regions)
    return tuple(TraceNote(text, regions, fallback) for (text, fallback), regions in merged.items())


def _activation_rows(report: Any) -> list[tuple[Any, Any, int]]:
    from fxmem.cost_model.memory import planned_bytes
    return [(r, s, planned_bytes(s, p)) for r, s, p in report.rows() if s.frees_memory]


def lora_order_table(model: torch.nn.Module, tokens: int, dtype: torch.dtype,
                     experts_per_token: int | None = None) -> list[LoraOrder]:
    """Every LoRA layer shape of ``model`` at ``tokens`` tokens, how many layers have it, and the order the FLOPs
    chooser picks.

    PEFT's LoRA on a mixture of experts' stacked weights (``ParamWrapper`` with ``num_experts`` > 1) stacks the
    experts' adapters, A as (experts x r, in) and B as (out, r x experts): read here as one LoRA of rank r per
    expert, each at ``tokens`` x top-k / experts tokens (rounded up), top-k being ``experts_per_token`` (default:
    the model's config's ``num_experts_per_tok``). That is the average: routing is assumed balanced, where a real
    router sends some experts more tokens than others. Their orders are those the experts' kernel may run
    (``choose_for_experts``: none folds the adapter into the weights; it picks at each call for the rows routed
    then). A ``ParamWrapper`` on a 2-D weight (a router's) is one LoRA of rank r at every token, as an adapted
    linear is."""
    counts: Counter[tuple[LoraShape, int]] = Counter()
    for module in model.modules():
        lora_a = getattr(module, "lora_A", None)
        if not (isinstance(lora_a, torch.nn.ModuleDict) and "default" in lora_a):
            continue
        experts = getattr(module, "num_experts", 1)  # ParamWrapper's; a LoRA linear has none
        per_expert = tokens
        if experts > 1:
            experts_per_token = experts_per_token or _experts_per_token(model)
            per_expert = -(-tokens * experts_per_token // experts)
        weight = lora_a["default"].weight
        counts[LoraShape(per_expert, module.in_features, module.out_features, weight.shape[0] // experts, dtype,
                         adapter_dtype=weight.dtype), experts] += 1
    return [LoraOrder(shape, count, choose_for_experts(shape) if experts > 1 else choose_by_flops(shape), experts)
            for (shape, experts), count in counts.items()]


def _experts_per_token(model: torch.nn.Module) -> int:
    """How many experts a token is routed to, from the model's config."""
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError("the model has LoRA on stacked experts but its config has no num_experts_per_tok: pass "
                         "experts_per_token (how many experts each token is routed to)")
    return top_k


def whatif(model: Any, *, batch: int, seq: int, rank: int = 16, dtype: str = "bf16", optimizer: str = "adamw",
           presets: list[str] | None = None, name: str | None = None, base: str = "float",
           shards: int = 1, strict: bool = False) -> WhatIf:
    """Memory per preset and LoRA orders of ``model`` (a named shape, a config.json or a transformers config),
    called ``name`` in the result (default: ``model`` if it is a name, else the config's model type). ``base``
    "nf4" prices the LoRA-targeted frozen weights as QLoRA stores them; what a step saves is the float base's
    (a frozen weight's storage changes no saved activation: bitsandbytes' 4-bit matmul keeps its input, which
    the LoRA branch saves anyway). Per rank: ``batch`` is a rank's; ``shards`` > 1 is FSDP2 over that many
    ranks, which holds 1/shards of the weights, gradients and optimizer state on each. Each preset's fallbacks and
    region notes are on its cost (``PresetCost.notes``); ``strict`` (or FXMEM_STRICT=1): a fallback raises
    FallbackError instead."""
    _check_choices(dtype, optimizer, base, rank)
    if shards < 1:
        raise ValueError(f"shards must be an integer >= 1; got {shards}")
    from fxmem.config import PRESETS
    presets = presets or list(PRESETS)
    config = hf_config(model)
    torch_dtype = DTYPES[dtype]
    lora_model = build_lora_model(config, rank, torch_dtype)
    weights, gradients, state = parameter_bytes(lora_model, optimizer, base, shards)
    adapter_dtype = next(p.dtype for p in lora_model.parameters() if p.requires_grad)
    name = name or (model if isinstance(model, str) else config.model_type)
    result = WhatIf(name, batch, seq, rank, torch_dtype, optimizer, adapter_dtype,
                    lora_orders=lora_order_table(lora_model, batch * seq, torch_dtype),
                    loss=loss_cost(config, batch * seq, torch_dtype, head_trains=not rank)
                    if is_causal_lm(config) else None)
    for preset in presets:
        activations, how = layer_scaled_activation_bytes(config, rank=rank, dtype=torch_dtype, batch=batch, seq=seq,
                                                         preset=Config.from_preset(preset, strict=strict))
        result.costs.append(PresetCost(preset, weights, gradients, state, activations.saved, how, activations.notes))
    return result


def _check_choices(dtype: str, optimizer: str, base: str, rank: int) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid dtypes: {', '.join(DTYPES)}")
    if base not in BASES:
        raise ValueError(f"unknown base {base!r}; valid bases: {', '.join(BASES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid optimizers: {', '.join(OPTIMIZER_STATES)}")
    if rank < 1:
        raise ValueError(f"rank must be an integer >= 1; got {rank}")


def _lora_targeted(lora_model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """PEFT's LoRA layers of ``lora_model``, by name: each wraps a frozen ``base_layer``."""
    return [(name, module) for name, module in lora_model.named_modules()
            if hasattr(module, "lora_A") and hasattr(module, "base_layer")]


def _nf4_weights(lora_model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The frozen weights QLoRA stores as NF4, by their LoRA layer's name: bitsandbytes quantizes linear layers
    only, so a LoRA on a parameter (PEFT's ``ParamWrapper``: the experts' stacked weights, a router's) leaves that
    weight in the model's dtype."""
    return [(name, module.base_layer.weight) for name, module in _lora_targeted(lora_model)
            if not hasattr(module, "parameter_name")]


def parameter_bytes(lora_model: torch.nn.Module, optimizer: str, base: str, shards: int = 1) -> tuple[int, int, int]:
    """Weights, gradients and optimizer state of ``lora_model`` per rank: every parameter (the LoRA-targeted frozen
    weights in NF4 for ``base`` "nf4"), the trainable ones' gradients in their dtype, and the optimizer's fp32
    state tensors per trainable parameter; 1/``shards`` of each under FSDP2 (``_nf4_weights``: which weights
    "nf4" stores as NF4)."""
    params = list(lora_model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    if base == "nf4":
        frozen = [weight for _, weight in _nf4_weights(lora_model)]
        weights += sum(nf4_nbytes(w.numel()) - w.numel() * w.element_size() for w in frozen)
    trainable = [p for p in params if p.requires_grad]
    gradients = sum(p.numel() * p.element_size() for p in trainable)
    state = OPTIMIZER_STATES[optimizer] * sum(p.numel() * 4 for p in trainable)
    weights, gradients, state = (-(-total // shards) for total in (weights, gradients, state))
    return weights, gradients, state


@dataclass(frozen=True)
class ContextFit:
    """The longest sequence (batch 1) a preset fits in a memory size, and the parts of its peak there."""

    preset: str
    seq: int  # a multiple of the granularity; 0: none fits
    shortest_failing: int | None  # the shortest length traced that does not fit
    weights: int
    optimizer_state: int
    saved_activations: int
    transient: int  # ActivationBytes.transient: backward's gradients and intermediates at its peak, or forward's
    how: str
    host_activations: int = 0  # ActivationBytes.host: in host memory, outside the total
    notes: tuple[TraceNote, ...] = ()  # the fallbacks and region notes of every length traced, each once

    @property
    def total(self) -> int:
        return self.weights + self.optimizer_state + self.saved_activations + self.transient

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def max_context(model: Any, memory: int, *, rank: int = 16, dtype: str = "bf16", optimizer: str = "adamw",
                presets: Sequence[str] = MAX_CONTEXT_PRESETS, base: str = "float", shards: int = 1,
                granularity: int = CONTEXT_GRANULARITY, max_seq: int = 1 << 24,
                options: Mapping[str, Any] | None = None, strict: bool = False) -> list[ContextFit]:
    """Per preset, the longest batch-1 sequence whose step fits ``memory`` bytes: weights, optimizer state, saved
    activations and the step's transients, traced on fake tensors at a few lengths (fxmem.fitting's search).
    Gradients are counted where they live, in backward's transients; ``shards`` and ``strict`` as in ``whatif``;
    ``options``: Config fields set on every preset (e.g. mlp_chunk, block_checkpoint), named in its label."""
    _check_choices(dtype, optimizer, base, rank)
    config = hf_config(model)
    torch_dtype = DTYPES[dtype]
    lora_model = build_lora_model(config, rank, torch_dtype)
    weights, _, state = parameter_bytes(lora_model, optimizer, base, shards)
    dequantized = dequantized_base_bytes(lora_model, options or {}) if base == "nf4" else 0
    start = min(8 * granularity, max_seq - max_seq % granularity)
    fields = {**(options or {}), **({"strict": True} if strict else {})}  # strict set in options stays on
    fits = []
    for preset in presets:
        fxmem_config = Config.from_preset(preset, return_logits=False, **fields)
        traced: dict[int, tuple[ActivationBytes, str]] = {}

        def probe(seq: int, fxmem_config: Config = fxmem_config, traced: dict = traced) -> Probe:
            traced[seq] = layer_scaled_activation_bytes(config, rank=rank, dtype=torch_dtype, batch=1, seq=seq,
                                                        preset=fxmem_config)
            activations = traced[seq][0]
            return Probe(seq, activations.step + dequantized, weights + state)

        fit = longest_fitting(probe, memory, start=start, granularity=granularity, max_seq=max_seq)
        activations, how = traced[fit.longest] if fit.longest else (ActivationBytes(0, 0), "")
        if not fit.converged:
            how = f"{how}; the search stopped before the bracket closed".lstrip("; ")
        label = preset + overrides_text(options or {})
        fits.append(ContextFit(label, fit.longest, fit.shortest_failing, weights, state, activations.saved,
                               activations.transient + (dequantized if fit.longest else 0), how, activations.host,
                               _merged_notes(*(traced_at.notes for traced_at, _ in traced.values()))))
    return fits


def dequantized_base_bytes(lora_model: torch.nn.Module, options: Mapping[str, Any]) -> int:
    """With an NF4 base, the float weights dequantized at once, which the traced float base holds as parameters
    instead: bitsandbytes dequantizes one weight for its product; a chunked MLP (``mlp_chunk``) reads its three, and
    chunked linears (``linear_chunk``) those that read one input, counted here as all of a module's LoRA-targeted
    projections (for an attention, its o projection too, which is an op of its own: an upper bound; so too under
    "auto", which may leave them whole)."""
    siblings: dict[str, list[int]] = {}
    for name, weight in _nf4_weights(lora_model):
        siblings.setdefault(name.rpartition(".")[0], []).append(weight.numel() * weight.element_size())
    one = max((size for sizes in siblings.values() for size in sizes), default=0)
    if options.get("mlp_chunk") is None and options.get("linear_chunk") is None:
        return one
    return max(one, *(sum(sizes) for sizes in siblings.values()))


def loss_cost(config: Any, tokens: int, dtype: torch.dtype, *, head_trains: bool) -> LossCost:
    """The causal LM loss of ``config`` over ``tokens`` tokens on a GPU, unfused and chunked."""
    size = torch.empty((), dtype=dtype).element_size()
    vocab, hidden = config.vocab_size, config.hidden_size
    chunks = loss_chunks(tokens, vocab, hidden, size, head_trains=head_trains, device_type="cuda")
    return LossCost(tokens, vocab, unfused_loss_bytes(tokens, vocab, size),
                    chunked_loss_bytes(tokens, vocab, hidden, size, chunks), chunks)


def traced_activation_bytes(config: Any, *, layers: int, rank: int, dtype: torch.dtype, batch: int, seq: int,
                            preset: Config) -> ActivationBytes:
    """``predicted_activation_bytes`` of the model of ``config`` cut to its first ``layers`` blocks, on fake
    tensors, under the fxmem config ``preset``."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (Qwen, Gemma)
        config.layer_types = config.layer_types[:layers]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_lora_model(config, rank, dtype, fake_mode)
    with fake_mode:
        inputs = example_batch(config, batch, seq, TRACE_DEVICE)
    return predicted_activation_bytes(model, inputs, preset)


def layer_scaled_activation_bytes(config: Any, *, rank: int, dtype: torch.dtype, batch: int, seq: int,
                                  preset: Config) -> tuple[ActivationBytes, str]:
    """Activation bytes of the whole model, with the fallbacks and region notes of every trace, and how they were
    found.

    Tracing costs time linear in the depth (seconds a block at llama-7b's width on a CPU), so a deep model is
    traced at ``SCALING_DEPTHS`` blocks, and one block more at a time up to ``MAX_SCALING_DEPTH``: when two
    consecutive steps add the same bytes, saved and transient, the blocks save alike and each total is the deepest
    trace plus that step per further block (whatever a block adds to backward's peak: the LoRA gradients of every
    block where the peak holds them). Past ``MAX_SCALING_DEPTH``, blocks that save alike but add unlike steps to
    the peak add the larger of the last two each (an assumed bound); otherwise the whole model is traced.

    Options set to "auto" are chosen region by region, as the backend chooses them (cost_model.auto.choose_auto):
    here at each depth traced, whose choice can differ from the whole model's.
    """
    met: list[tuple[TraceNote, ...]] = []  # every trace's notes: each depth's regions may meet others

    def traced(layers: int) -> ActivationBytes:
        activations = traced_activation_bytes(config, layers=layers, rank=rank, dtype=dtype, batch=batch, seq=seq,
                                              preset=preset)
        met.append(activations.notes)
        return activations

    def with_every_note(activations: ActivationBytes) -> ActivationBytes:
        return replace(activations, notes=_merged_notes(*met))

    def step(shallow: ActivationBytes, deep: ActivationBytes) -> tuple[int, int, int, int]:
        return (deep.saved - shallow.saved, deep.forward_transient - shallow.forward_transient,
                deep.backward_peak - shallow.backward_peak, deep.host - shallow.host)

    depth = config.num_hidden_layers
    if depth <= SCALING_DEPTHS[-1]:
        return with_every_note(traced(depth)), f"all {depth} layers traced"
    depths = list(SCALING_DEPTHS)
    traces = [traced(d) for d in depths]
    # Where the peak sits in a shallow trace can differ (checkpointed blocks: at 2 blocks backward's peak is
    # elsewhere than at 3 and more), so one block more is traced until two steps agree.
    bound = ""
    while step(*traces[-3:-1]) != step(*traces[-2:]):
        if depths[-1] + 1 >= depth:
            return with_every_note(traced(depth)), f"all {depth} layers traced (blocks do not save alike)"
        if depths[-1] + 1 > MAX_SCALING_DEPTH:
            earlier, last = step(*traces[-3:-1]), step(*traces[-2:])
            if (earlier[0], earlier[1], earlier[3]) != (last[0], last[1], last[3]):
                return with_every_note(traced(depth)), f"all {depth} layers traced (blocks do not save alike)"
            # The blocks save alike but add unlike amounts to the peak: inductor keeps freed buffers for reuse
            # while its estimate has room, and the room grows by what backward frees (analysis/liveness.py), in
            # steps that need not repeat. The larger of the last two steps is taken for each further block's: an
            # assumed bound (on the tests' model, from 6 blocks to 9, they add nothing more).
            traces[-1] = replace(traces[-1], backward_peak=traces[-2].backward_peak + max(earlier[2], last[2]))
            bound = " (the larger of two steps: the steps to the peak differ from block to block)"
            break
        depths.append(depths[-1] + 1)
        traces.append(traced(depths[-1]))
    # what each further block adds: saved, at the peak, and in host memory
    per_layer, forward_per_layer, backward_per_layer, host_per_layer = step(*traces[-2:])
    further = depth - depths[-1]
    deepest = traces[-1]
    forward = deepest.forward_transient + further * forward_per_layer
    backward = deepest.backward_peak + further * backward_per_layer
    transient_per_layer = (max(forward, backward) - max(deepest.forward_transient, deepest.backward_peak)) // further
    scaled = ActivationBytes(deepest.saved + further * per_layer, max(forward, backward),
                             deepest.host + further * host_per_layer, _merged_notes(*met), forward, backward)
    return scaled, (f"traced at {', '.join(map(str, depths))} layers, each further layer saves "
                    f"{per_layer / 2**20:.2f} MiB and adds {transient_per_layer / 2**20:.2f} MiB to the "
                    f"transients{bound}; scaled to {depth}")


def plot(result: WhatIf, path: pathlib.Path) -> None:
    """Stacked bars, one per preset: weights, gradients, optimizer state, saved activations (GiB)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    parts = [("weights", "weights"), ("gradients", "gradients"), ("optimizer state", "optimizer_state"),
             ("saved activations", "saved_activations")]
    names = [c.preset for c in result.costs]
    figure, axes = plt.subplots(figsize=(1.6 * len(names) + 2.5, 4.2))
    bottom = [0.0] * len(names)
    for label, attribute in parts:
        heights = [getattr(c, attribute) / 2**30 for c in result.costs]
        axes.bar(names, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    for x, total in enumerate(bottom):
        axes.text(x, total, f"{total:.1f}", ha="center", va="bottom")
    dtype = str(result.dtype).removeprefix("torch.")
    axes.set_ylabel("GiB")
    axes.set_title(f"{result.model}, batch {result.batch} x {result.seq}, LoRA r={result.rank}, {dtype}, "
                   f"{result.optimizer}", fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def measured_saved_bytes(model: Any, *, batch: int, seq: int, rank: int, dtype: str, preset: str,
                         lowering: str = "inductor") -> int:
    """Saved-activation bytes of one real compiled training forward on the CPU (random weights), as
    fxmem.measure defines them: the check on ``predicted_saved_bytes``. ``lowering="eager"`` runs the
    rewritten graphs without inductor: the same saved tensors, compiled in a fraction of the time."""
    from fxmem.backend import Backend
    from fxmem.measure import model_tensors, saved_activation_bytes
    config = hf_config(model)
    torch.manual_seed(0)
    lora_model = build_lora_model(config, rank, DTYPES[dtype], device="cpu")
    inputs = example_batch(config, batch, seq, "cpu")
    torch._dynamo.reset()
    compiled = torch.compile(lora_model, backend=Backend(Config.from_preset(preset), lowering=lowering))

    def forward() -> torch.Tensor:
        output = compiled(**inputs)
        return output.loss if getattr(output, "loss", None) is not None else output.last_hidden_state.float().mean()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saved, loss = saved_activation_bytes(forward, [*model_tensors(lora_model), *inputs.values()])
    loss.backward()
    return saved
