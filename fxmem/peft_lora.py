"""PEFT's LoRA on parameters (a router's weight, the experts' stacked weights), made compilable and unmerged.

PEFT adapts a parameter that is not an ``nn.Linear`` (``target_parameters``, or ``"all-linear"`` on a mixture of
experts) with ``ParamWrapper``: at every forward it registers a ``torch.nn.utils.parametrize`` parametrization that
adds the adapter to the weight, and removes it after. Registering one makes a new class each time, so dynamo
recompiles that module at every step (its guards check the module's type) and breaks the graph around it; and the
experts' weights are merged, ``W + s * lhs @ rhs`` per expert, so autograd keeps a copy of every expert's weight for
the input's gradient.

``prepare_peft`` gives every outermost ``ParamWrapper`` a forward of its own that registers nothing (its class
becomes a subclass with that forward):
- transformers' experts (the modules of ``use_experts_implementation``) run grouped by expert with each adapter
  applied as its two small products (``fxmem.kernels.grouped_lora``) beside the frozen grouped matmul, so
  neither the merged weights nor the deltas exist in forward or backward;
- any other parameter (a router's weight) is merged as PEFT merges it and passed in by ``functional_call``.
PEFT's own forward runs where these do not apply (adapters disabled or merged, ``adapter_names``, expert
parallelism), so that the result is PEFT's in every case.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fxmem.config import Config
from fxmem.cost_model.auto import chunk_rows
from fxmem.cost_model.lora_orders import LoraShape, choose_for_experts
from fxmem.kernels import grouped_lora as grouped_lora_kernel
from fxmem.kernels.grouped_lora import grouped_lora

# The weights transformers' experts read, by the gate they have: ``has_gate`` (a fused gate and up projection) or
# not; ``down_proj`` in both.
_EXPERT_WEIGHTS = ({"gate_up_proj", "down_proj"}, {"up_proj", "down_proj"})


def prepare_peft(model: torch.nn.Module, config: Config | None = None) -> list[str]:
    """Give each outermost PEFT ``ParamWrapper`` of ``model`` fxmem's forward (see the module's docstring), in
    place; return the names of the modules changed (none without PEFT or without parameter LoRA). Calling it again
    changes nothing but the experts' chunks. ``config``: the fxmem config the model will be compiled with, whose
    ``mlp_chunk`` runs the experts that many tokens at a time (``_experts_forward``): dynamo traces the forward
    before fxmem's backend sees the graph. Without it, the chunks set before stay. ``fxmem.compile_``,
    ``fxmem.inspect`` and ``fxmem.check_fidelity`` call it; call it yourself before ``torch.compile(model,
    backend=fxmem.backend(...))``, with ``config=backend.config`` where that sets ``mlp_chunk``."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:
        return []
    wrappers = {name: module for name, module in model.named_modules() if isinstance(module, ParamWrapper)}
    inner = {id(module.base_layer) for module in wrappers.values()}
    changed = []
    for name, module in wrappers.items():
        if id(module) in inner:
            continue
        if config is not None or not hasattr(module, _CHUNK):
            setattr(module, _CHUNK, config.mlp_chunk if config is not None else None)
        if type(module) in _PREPARED.values():
            continue
        module.__class__ = _prepared_class(type(module))
        changed.append(name)
    return changed


@contextlib.contextmanager
def prepared_for(model: torch.nn.Module, config: Config) -> Iterator[None]:
    """``prepare_peft(model, config)`` while inside, the experts' chunks set before restored after: ``fxmem.inspect``
    and ``fxmem.check_fidelity`` leave a model compiled for another config as it was."""
    before = {module: getattr(module, _CHUNK) for module in model.modules() if hasattr(module, _CHUNK)}
    prepare_peft(model, config)
    try:
        yield
    finally:
        for module, chunk in before.items():
            setattr(module, _CHUNK, chunk)


_CHUNK = "fxmem_mlp_chunk"  # a prepared wrapper's Config.mlp_chunk
_PREPARED: dict[type, type] = {}


def _prepared_class(cls: type) -> type:
    """``cls`` with fxmem's forward: a subclass (PEFT's isinstance checks hold), one per class, so that dynamo's
    guards on the module's type hold from step to step; bound to this module's name, so that a prepared model
    pickles (``torch.save(model)``)."""
    if cls not in _PREPARED:
        name = f"Prepared{cls.__name__}"
        _PREPARED[cls] = globals()[name] = type(name, (cls,), {"forward": _wrapper_forward, "__module__": __name__})
    return _PREPARED[cls]


def _chain(wrapper: torch.nn.Module) -> list[torch.nn.Module]:
    """The nested ParamWrappers from ``wrapper`` inward, one per adapted parameter of the same base module."""
    from peft.tuners.lora.layer import ParamWrapper
    chain = [wrapper]
    while isinstance(chain[-1].base_layer, ParamWrapper):
        chain.append(chain[-1].base_layer)
    return chain


def _wrapper_forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    from peft.tuners.lora.layer import ParamWrapper
    chain = _chain(self)
    base = chain[-1].base_layer
    if "adapter_names" in kwargs or any(w.disable_adapters or w.merged for w in chain):
        return ParamWrapper.forward(self, x, *args, **kwargs)
    adapted = [w for w in chain if _active(w)]
    factors = {w.parameter_name: _factors(w) for w in adapted}
    if _unmerged_experts(base, factors):
        return _experts_forward(base, factors, getattr(self, _CHUNK, None), x, *args, **kwargs)
    merged = {w.parameter_name: _merged_weight(w) for w in adapted}
    return torch.func.functional_call(base, merged, (x, *args), kwargs)


def _active(wrapper: torch.nn.Module) -> list[str]:
    return [name for name in wrapper.active_adapters if name in wrapper.lora_A]


def _factors(wrapper: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(lhs, rhs, scaling)``, the delta being ``scaling * lhs @ rhs`` in the parameter's layout, (E, p1, r) and
    (E, r, p2), where PEFT folds the adapter by its factors (one adapter, several experts, a float weight); else
    None. PEFT's ``get_delta_factors`` without its cast to the weight's dtype: these are views of the adapter's
    parameters."""
    adapters = _active(wrapper)
    if len(adapters) != 1 or wrapper.num_experts == 1 or not wrapper.get_param().dtype.is_floating_point:
        return None
    from peft.utils.constants import UPCAST_DTYPES
    if any(getattr(torch, name, None) == wrapper.get_param().dtype for name in UPCAST_DTYPES):
        return None
    adapter = adapters[0]
    experts = wrapper.num_experts
    lora_a = wrapper.lora_A[adapter].weight
    lora_a = lora_a.reshape(experts, -1, lora_a.shape[-1])  # (E, r, in)
    lora_b = wrapper.lora_B[adapter].weight
    lora_b = lora_b.reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1)  # (E, out, r)
    if wrapper._did_swap_in_out_features:
        return lora_b, lora_a, wrapper.scaling[adapter]
    return lora_a.transpose(-2, -1), lora_b.transpose(-2, -1), wrapper.scaling[adapter]


def _merged_weight(wrapper: torch.nn.Module) -> torch.Tensor:
    """The parameter with its active adapters added, by PEFT's own proxies (the math of its parametrization)."""
    from peft.tuners.lora.layer import _LoraParameterProxy
    weight = wrapper.get_param()
    factors = _factors(wrapper)
    if factors is not None:  # PEFT's _LoraFactorsProxy (peft >= 0.21): the fold in W's dtype, autocast off
        lhs, rhs, scaling = factors
        with torch.autocast(device_type=weight.device.type, enabled=False):
            return torch.baddbmm(weight, lhs.to(weight.dtype), rhs.to(weight.dtype), alpha=scaling)
    deltas = [wrapper.get_delta_weight(name) for name in _active(wrapper)]
    return _LoraParameterProxy(sum(deltas[1:], deltas[0]))(weight)


def _unmerged_experts(base: torch.nn.Module, factors: dict[str, Any]) -> bool:
    """transformers' experts (``use_experts_implementation``), not expert-parallel, with every adapted weight
    given by its factors (``factors``: None for a weight PEFT merges whole)."""
    if not hasattr(base, "is_transposed") or getattr(base, "_is_expert_parallel", True) or not factors:
        return False
    weights = _EXPERT_WEIGHTS[0] if getattr(base, "has_gate", True) else _EXPERT_WEIGHTS[1]
    return (set(factors) <= weights and all(value is not None for value in factors.values())
            and all(hasattr(base, name) for name in weights))


def _experts_forward(experts: torch.nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                     chunk: int | str | None, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """``_routed_forward`` over every token, or ``chunk`` tokens at a time (``Config.mlp_chunk``): the
    expert-wide tensors (the routed rows, their products, their gradients) then exist one chunk at a time, in
    forward, and in backward where it replays the experts' products (``rebuild_from_x``) or reads each chunk's
    saved tensors. Routing is per token: the chunks' results are the whole's."""
    rows = _chunk_tokens(chunk, experts, hidden_states, top_k_index)
    if rows >= hidden_states.size(0):
        return _routed_forward(experts, factors, hidden_states, top_k_index, top_k_weights)
    return torch.cat([_routed_forward(experts, factors, *parts) for parts in zip(
        hidden_states.split(rows), top_k_index.split(rows), top_k_weights.split(rows), strict=True)])


def _chunk_tokens(chunk: int | str | None, experts: torch.nn.Module, hidden_states: torch.Tensor,
                  top_k_index: torch.Tensor) -> int:
    """The tokens per chunk: all of them without ``chunk``; under "auto", as many as hold no more routed rows and
    products than the experts' input (``chunk_rows``). Under dynamic shapes dynamo guards on how many chunks a
    length makes: a length that makes another count compiles again."""
    tokens = hidden_states.size(0)
    if chunk is None:
        return tokens
    up = getattr(experts, "gate_up_proj" if experts.has_gate else "up_proj")
    width = up.shape[-1] if experts.is_transposed else up.shape[-2]  # the up product's, a fused gate's included
    hidden = hidden_states.size(-1)
    # a token's rows per expert it is routed to: its input gathered, the up product, the activation, the output
    row = top_k_index.size(-1) * (2 * hidden + width + (width // 2 if experts.has_gate else width))
    size = hidden_states.element_size()
    return chunk_rows(chunk, tokens, hidden * size, lambda backward: row * size)


def _routed_forward(experts: torch.nn.Module, factors: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                    hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                    ) -> torch.Tensor:
    """transformers' grouped experts forward (``grouped_mm_experts_forward``: tokens sorted by expert, one grouped
    matmul per projection), each adapted projection's LoRA as its two small grouped products."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.size(-1)
    expert_ids, order = torch.sort(top_k_index.reshape(-1))
    routed = hidden_states[order // top_k]
    routing_weights = top_k_weights.reshape(-1)[order]
    # histc rather than bincount (no CUDA sync); on CPU and MPS it takes floats only
    counted = expert_ids.float() if hidden_states.device.type in ("cpu", "mps") else expert_ids.int()
    per_expert = torch.histc(counted, bins=experts.num_experts, min=0, max=experts.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)

    up = "gate_up_proj" if experts.has_gate else "up_proj"
    out = _lora_grouped_linear(experts, up, routed, offsets, expert_ids, factors.get(up))
    out = experts._apply_gate(out) if experts.has_gate else experts.act_fn(out)
    out = _lora_grouped_linear(experts, "down_proj", out, offsets, expert_ids, factors.get("down_proj"))
    if experts.has_post_expert_norm:
        out = experts.post_expert_norm(out)
    out = out * routing_weights.unsqueeze(-1)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.numel(), device=order.device)
    return out[restore].view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def _lora_grouped_linear(experts: torch.nn.Module, name: str, x: torch.Tensor, offsets: torch.Tensor,
                         expert_ids: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor, float] | None
                         ) -> torch.Tensor:
    """One grouped projection of the frozen weight ``name``, plus its adapter ``scaling * lhs @ rhs`` (in the
    weight's layout) as ``(x a) b`` per expert: x times the weight's transpose unless the weights are stored
    transposed, (in, out) per expert."""
    from transformers.integrations.moe import _grouped_linear
    bias = getattr(experts, f"{name}_bias")[expert_ids] if experts.has_bias else None
    out = _grouped_linear(x, getattr(experts, name), offsets, bias=bias, is_transposed=experts.is_transposed)
    if factors is None:
        return out
    lhs, rhs, scaling = factors
    a, b = (lhs, rhs) if experts.is_transposed else (rhs.transpose(-2, -1), lhs.transpose(-2, -1))
    lora = grouped_lora(x, a, b, offsets)
    # the sum in the adapters' dtype, rounded once to the weights': PEFT's order for a dense LoRA linear
    return (out.to(lora.dtype) + scaling * lora).to(out.dtype)


def _experts_order(rows: int, in_features: int, out_features: int, rank: int, dtype: torch.dtype,
                   adapter_dtype: torch.dtype) -> str:
    """The cost model's backward order for one expert's LoRA at ``rows`` rows (the routed rows' mean over the
    experts), as ``fxmem whatif`` prices it: what ``fxmem::grouped_lora``'s backward runs."""
    return choose_for_experts(LoraShape(rows, in_features, out_features, rank, dtype,
                                        adapter_dtype=adapter_dtype)).backward


grouped_lora_kernel.choose_backward_order = _experts_order
