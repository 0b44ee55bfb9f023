"""Measuring a training step: saved-activation bytes, peak memory, step time, gradient fidelity.

These are the definitions of docs/methodology.md; the benchmark, the
fine-tuning demo and the tests all measure through them.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._C._profiler import _EventType

T = TypeVar("T")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Parameters, buffers and a quantized weight's state (bitsandbytes' ``quant_state``: scales, code, nested
    state): storages that exist anyway and are never counted as activations."""
    tensors = [*model.parameters(), *model.buffers()]
    states = [p.quant_state for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    while states:
        state = states.pop()
        for value in vars(state).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif hasattr(value, "__dict__") and not callable(value):
                states.append(value)  # the double quantization's own state
    return tensors


def saved_activation_bytes(forward: Callable[[], T], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, T]:
    """Bytes of the distinct storages autograd keeps for backward while ``forward`` runs.

    Each storage counts once, at its full size. Storages of ``exclude`` (pass the
    model's parameters and buffers and the batch's tensors) are left out. Works
    for eager and compiled models alike: AOTAutograd saves its tensors through
    the same hooks. Tensors an ``autograd.Function`` stashes on its ctx instead of
    saving them pass no hook (bitsandbytes' 4-bit matmul keeps its input so, and
    AOTAutograd then keeps them on its own ctx): they are read off the autograd
    graph once ``forward`` returns. Returns the bytes and ``forward``'s result, so
    that the caller can run backward on it.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer and pointer not in excluded:
            storages[pointer] = storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        count(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    for tensor in _stashed_on_ctx(result):
        count(tensor)
    return sum(storages.values()), result


def saved_bytes_and_gradients(model: torch.nn.Module, loss: Callable[[], torch.Tensor],
                              exclude: Iterable[torch.Tensor] = ()) -> tuple[int, dict[str, torch.Tensor]]:
    """One forward (``loss``) and backward: the bytes autograd saved (``saved_activation_bytes``) and a copy of
    every trainable gradient of ``model``, whose gradients are cleared after."""
    saved, value = saved_activation_bytes(loss, exclude)
    value.backward()
    grads = trainable_gradients(model)
    model.zero_grad(set_to_none=True)
    return saved, grads


def _stashed_on_ctx(result: object) -> list[torch.Tensor]:
    """Tensors held as attributes (alone, or in a tuple or list) of the custom-Function nodes of the autograd
    graph behind ``result``'s tensors."""
    roots = [t.grad_fn for t in _tensors_in(result) if t.grad_fn is not None]
    seen, found = set(), []
    while roots:
        node = roots.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        roots += [next_node for next_node, _ in node.next_functions]
        for value in getattr(node, "__dict__", {}).values():
            found += [v for v in (value if isinstance(value, (tuple, list)) else [value]) if isinstance(v, torch.Tensor)]
    return found


def _tensors_in(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_in(v)]
    return []


def peak_memory(step: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes allocated while ``step`` runs, above what was allocated when it began.

    Relative on both devices, so that it stays the step's own cost when other
    models share the device (add ``static_bytes`` for the whole footprint).
    CUDA: ``torch.cuda`` allocator statistics. CPU: the running sum of the
    profiler's allocation events (``torch.cpu`` keeps no statistics).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    # Kineto prints a line at every start and stop, and the allocator one when a block older than the profile is
    # freed: native writes, past Python's streams, which keep the terminal.
    with _native_stderr_silenced(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                           profile_memory=True) as prof:
        step()
    allocations: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    allocations.sort()
    current = peak = 0
    for _, size in allocations:
        current += size
        peak = max(peak, current)
    return peak


@contextlib.contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at the null device, for native code that writes there directly; Python's
    ``sys.stderr`` (warnings, tracebacks) meanwhile writes where fd 2 pointed before."""
    sys.stderr.flush()
    saved = os.dup(2)
    python_stderr = sys.stderr
    sys.stderr = open(os.dup(saved), "w", buffering=1, encoding=python_stderr.encoding or "utf-8")  # noqa: SIM115
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.close()
        sys.stderr = python_stderr
        os.dup2(saved, 2)
        os.close(saved)


def static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes that live across steps: parameters, buffers and optimizer state, each storage once."""
    tensors = model_tensors(model)
    if optimizer is not None:
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def trainable_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every trainable parameter's gradient (zeros where backward left none)."""
    return {name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for name, p in model.named_parameters() if p.requires_grad}


@dataclass(frozen=True)
class Fidelity:
    """How close a candidate's gradients are to a reference's, parameter by parameter."""

    min_cosine: float
    median_relative_error: float
    worst_parameter: str
    compared: int | None = None  # gradients compared; None: a result written before the count was kept
    zero_in_reference: int = 0  # of them, gradients zero in the reference (gradient_fidelity refuses any)

    def to_dict(self) -> dict[str, Any]:
        return {"min_cosine": self.min_cosine, "median_relative_error": self.median_relative_error,
                "worst_parameter": self.worst_parameter, "compared": self.compared,
                "zero_in_reference": self.zero_in_reference}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fidelity:
        """The fidelity ``to_dict`` wrote."""
        return cls(data["min_cosine"], data["median_relative_error"], data["worst_parameter"], data.get("compared"),
                   data.get("zero_in_reference", 0))


class ZeroGradientError(ValueError):
    """A fidelity figure over a gradient that is zero in the reference: a cosine of zeros against zeros measures
    nothing, and counted as 1 it hides what the candidate does to that parameter."""


def gradient_fidelity(reference: Mapping[str, torch.Tensor], candidate: Mapping[str, torch.Tensor]) -> Fidelity:
    """Minimum cosine similarity and median relative L2 error over the parameters of ``reference``, every one of
    them compared: a reference gradient that is zero (PEFT's LoRA A while B is at its zero init) is refused
    (ZeroGradientError), since there is nothing to compare it with."""
    missing = sorted(set(reference) - set(candidate))
    if missing:
        raise ValueError(f"candidate has no gradient for {', '.join(missing[:5])}")
    if not reference:
        raise ValueError("no gradients to compare: the reference has no trainable parameters")
    zero = [name for name, ref in reference.items() if not ref.any()]
    if zero:
        raise ZeroGradientError(
            f"{len(zero)} of {len(reference)} reference gradients are zero (e.g. {zero[0]}), so the figure would "
            "compare zeros with zeros: LoRA A has no gradient while B is at PEFT's zero init. Draw B past its init "
            "(the benchmark workloads' lora_b_std) or compare after a training step")
    cosines, errors = _compared(reference, candidate)
    worst = min(cosines, key=cosines.get)
    return Fidelity(min_cosine=cosines[worst], median_relative_error=statistics.median(errors),
                    worst_parameter=worst, compared=len(reference))


def gradient_cosines(reference: Mapping[str, torch.Tensor],
                     candidate: Mapping[str, torch.Tensor | None]) -> dict[str, float]:
    """Each reference gradient's cosine similarity with the candidate's, in float64 (0 for a candidate gradient that
    is missing or zero), with one sync with the device for them all."""
    return _compared(reference, candidate)[0]


def _compared(reference: Mapping[str, torch.Tensor],
              candidate: Mapping[str, torch.Tensor | None]) -> tuple[dict[str, float], list[float]]:
    """Each gradient's cosine with its reference and its relative L2 error, in float64; the figures gathered on the
    first reference's device (a model split over devices) and read in one sync."""
    device = next(iter(reference.values())).device
    figures = []
    for name, ref in reference.items():
        grad = candidate.get(name)
        ref64 = ref.detach().double().flatten()
        cand64 = torch.zeros_like(ref64) if grad is None else grad.detach().double().flatten().to(ref64.device)
        ref_norm = ref64.norm()
        cosine = ref64 @ cand64 / (ref_norm * cand64.norm()).clamp_min(torch.finfo(torch.float64).tiny)
        figures.append(torch.stack([cosine, (cand64 - ref64).norm() / ref_norm]).to(device))
    cosines, errors = torch.stack(figures).T.tolist()
    return dict(zip(reference, cosines, strict=True)), errors


def cosine_and_error(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """One gradient's cosine similarity and relative L2 error against its reference."""
    fidelity = gradient_fidelity({"p": reference}, {"p": candidate})
    return fidelity.min_cosine, fidelity.median_relative_error
