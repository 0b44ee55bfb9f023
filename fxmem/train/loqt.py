"""LoQT ("Low-Rank Adapters for Quantized Pretraining", Loeschcke et al., 2024): a model whose weights stay 4-bit.

A converted linear computes ``y = x deq(W)^T + s * x (P B)^T`` (or ``(B P)^T``):
W is stored NF4 (bitsandbytes, block 64, double-quantized scales), P holds the
top-r singular vectors of W's gradient on one batch, on the side of W's smaller
dimension (the paper's one-sided projection), frozen and optionally NF4 too, and
only B trains. On a schedule in optimizer steps (a first interval, then
exponentially growing ones) every layer merges, one layer at a time:

    W <- Q(deq(W) + s P B);  P <- SVD of a fresh gradient;  B <- error compensation

where B is chosen to cancel the quantization error Q(W) - W (pseudo-inverse of P,
up to five refinements, the best kept) and B's optimizer state is reset.

    config = LoQTConfig(rank=64)
    model = convert(model, config, gradient_loss)                   # gradient_loss(model) -> loss on a batch
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loqt = LoQT(model, config, optimizer, gradient_loss)            # merges after the scheduled optimizer steps
    compiled = torch.compile(model, backend="fxmem")                # optional
    ... loss.backward(); optimizer.step(); optimizer.zero_grad() ...

W's gradient comes from one extra forward/backward of ``gradient_loss`` on the
uncompiled model, in which each layer computes its own ``dY^T X`` during backward
and merges at once, so at most one layer's gradient and dequantized weight exist
at a time, and no ``.grad`` of the model is touched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fxmem.kernels.nf4 import NF4Parts, nf4_dequantize, nf4_layout, nf4_nbytes, nf4_quantize

Schedule = Literal["exponential", "fixed"]
SCHEDULES = ("exponential", "fixed")
GradientLoss = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class LoQTConfig:
    """What to convert and how to train it. Defaults are the paper's pretraining settings.

    rank: r, the columns of P and B.
    target: which ``nn.Linear`` to convert: a regex full-matched against module names, or a predicate
        ``(name, module) -> bool``; None converts every linear inside a numbered block (``...layers.3.mlp.up_proj``):
        the attention and MLP projections, not the embeddings or the output head, as the paper.
    scale: s in ``W + s P B`` (the paper's alpha, used as is, not divided by r).
    quantize: store W as NF4; False is LoQT-nq.
    quantize_projection: store P as NF4.
    first_interval: optimizer steps before the first merge.
    schedule: "exponential": the k-th interval after the first is ``first_interval + floor(growth**k)``
        (the paper's update schedule); "fixed": every interval is ``first_interval``.
    growth: the exponential schedule's base.
    compensation_steps: refinements of B against the quantization error at a merge; 0 sets B = 0.
    """

    rank: int
    target: str | Callable[[str, nn.Module], bool] | None = None
    scale: float = 0.5
    quantize: bool = True
    quantize_projection: bool = True
    first_interval: int = 100
    schedule: Schedule = "exponential"
    growth: float = 1.2
    compensation_steps: int = 5

    def __post_init__(self) -> None:
        _check_int("rank", self.rank, 1)
        _check_int("first_interval", self.first_interval, 1)
        _check_int("compensation_steps", self.compensation_steps, 0)
        for name in ("quantize", "quantize_projection"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale must be a finite number > 0; got {self.scale!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if not (isinstance(self.growth, (int, float)) and math.isfinite(self.growth) and self.growth >= 1):
            raise ValueError(f"growth must be a finite number >= 1; got {self.growth!r}")
        if isinstance(self.target, str):
            try:
                re.compile(self.target)
            except re.error as error:
                raise ValueError(f"target is not a valid regular expression: {self.target!r} ({error})") from None
        elif self.target is not None and not callable(self.target):
            raise ValueError("target must be a regex string, a predicate (name, module) -> bool, or None; "
                             f"got {self.target!r}")

    def merge_step(self, merge: int) -> int:
        """The optimizer step after which the ``merge``-th merge (1-based) runs."""
        _check_int("merge", merge, 1)
        if self.schedule == "fixed":
            return merge * self.first_interval
        return merge * self.first_interval + sum(math.floor(self.growth**k) for k in range(1, merge))

    def merge_steps(self, until: int) -> list[int]:
        """Every merge step up to and including optimizer step ``until``."""
        steps, merge = [], 1
        while (step := self.merge_step(merge)) <= until:
            steps.append(step)
            merge += 1
        return steps

    def selects(self, name: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if self.target is None:
            return re.search(r"\.\d+\.", name) is not None
        if isinstance(self.target, str):
            return re.fullmatch(self.target, name) is not None
        return bool(self.target(name, module))


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")


class FrozenMatrix(nn.Module):
    """A frozen matrix, stored NF4 (four buffers, see fxmem.kernels.nf4) or as it is (one buffer)."""

    def __init__(self, shape: tuple[int, int], *, quantized: bool, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.quantized = quantized
        if quantized:
            for name, (size, stored_dtype) in nf4_layout(math.prod(shape)).items():
                self.register_buffer(name, torch.zeros(size, dtype=stored_dtype, device=device))
        else:
            self.register_buffer("value", torch.zeros(shape, dtype=dtype, device=device))

    @property
    def nbytes(self) -> int:
        return nf4_nbytes(math.prod(self.shape)) if self.quantized else self.value.numel() * self.value.element_size()

    @torch.no_grad()
    def assign(self, value: torch.Tensor | NF4Parts) -> None:
        """Store ``value`` (a matrix, quantized here if this is NF4, or parts already quantized)."""
        if not self.quantized:
            self.value.copy_(value)
            return
        parts = value if isinstance(value, NF4Parts) else nf4_quantize(value)
        for name in ("packed", "absmax", "absmax_scale", "absmax_offset"):
            getattr(self, name).copy_(getattr(parts, name))

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrix (dequantized if NF4) in ``dtype``."""
        if not self.quantized:
            return self.value.to(dtype)
        return nf4_dequantize(self.packed, self.absmax, self.absmax_scale, self.absmax_offset, self.shape, dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ M^T``, never holding a dequantized M from forward to backward."""
        if not self.quantized:
            return F.linear(x, self.value)
        return torch.ops.fxmem.nf4_linear(x, self.packed, self.absmax, self.absmax_scale, self.absmax_offset,
                                          self.shape[0])

    def extra_repr(self) -> str:
        return f"shape={self.shape}, {'nf4' if self.quantized else self.value.dtype}"


class LoQTLinear(nn.Module):
    """``y = x deq(W)^T + s * update + bias``; only ``b`` (B) trains.

    P on the input side (in_features <= out_features): P is (r, in), B is (out, r), the update is ``x P^T B^T``.
    On the output side: P is (out, r), B is (r, in), the update is ``x B^T P^T``. B always spans W's larger
    dimension, as GaLore's one-sided projection keeps the larger side in the optimizer.
    """

    def __init__(self, in_features: int, out_features: int, config: LoQTConfig, *, bias: bool,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__()
        rank = config.rank
        if rank > min(in_features, out_features):
            raise ValueError(f"rank {rank} exceeds min(in_features, out_features) = "
                             f"{min(in_features, out_features)}: W's gradient has no more singular vectors")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.scale = float(config.scale)
        self.compensation_steps = config.compensation_steps
        self.side: Literal["input", "output"] = "input" if in_features <= out_features else "output"
        p_shape = (rank, in_features) if self.side == "input" else (out_features, rank)
        b_shape = (out_features, rank) if self.side == "input" else (rank, in_features)
        self.weight = FrozenMatrix((out_features, in_features), quantized=config.quantize, dtype=dtype, device=device)
        self.projection = FrozenMatrix(p_shape, quantized=config.quantize_projection, dtype=dtype, device=device)
        self.b = nn.Parameter(torch.zeros(b_shape, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self._initial_weight: torch.Tensor | None = None  # the original W, until the first projection
        self._probe: _Probe | None = None  # set while a gradient pass runs

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: LoQTConfig) -> LoQTLinear:
        """A LoQT linear that holds ``linear``'s weight until its first projection (see ``convert``)."""
        weight = linear.weight
        layer = cls(linear.in_features, linear.out_features, config, bias=linear.bias is not None,
                    dtype=weight.dtype, device=weight.device)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        layer._initial_weight = weight.detach()
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._probe is not None:
            return _WeightGradient.apply(x, self._probe.anchor, self)
        if self._initial_weight is not None:
            raise RuntimeError("this LoQT layer has no projection yet: convert() computes it from a gradient")
        leading = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        y = self.weight.linear(x)
        if self.side == "input":
            update = F.linear(self.projection.linear(x), self.b)
        else:
            update = self.projection.linear(F.linear(x, self.b))
        y = y + self.scale * update
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*leading, self.out_features)

    def update_matrix(self, projection: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """P B or B P as an (out, in) matrix, unscaled."""
        return b @ projection if self.side == "input" else projection @ b

    @torch.no_grad()
    def effective_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """deq(W) + s P B: the (out, in) weight this layer applies (its original weight before the first merge)."""
        if self._initial_weight is not None:
            return self._initial_weight.to(dtype)
        projection = self.projection.get(torch.float32)
        weight = self.weight.get(torch.float32) + self.scale * self.update_matrix(projection, self.b.float())
        return weight.to(dtype)

    @torch.no_grad()
    def merge(self, weight: torch.Tensor, gradient: torch.Tensor) -> None:
        """Store ``weight`` (the merged W), with P from ``gradient``'s SVD and B compensating W's quantization error."""
        weight, gradient = weight.float(), gradient.float()
        u, _, vh = torch.linalg.svd(gradient, full_matrices=False)
        self.projection.assign(vh[:self.rank] if self.side == "input" else u[:, :self.rank])
        projection = self.projection.get(torch.float32)
        if self.weight.quantized and self.compensation_steps:
            stored, b = self._compensated(weight, projection)
        else:
            stored, b = weight, torch.zeros_like(self.b, dtype=torch.float32)
        self.weight.assign(stored)
        self.b.copy_(b)
        self._initial_weight = None

    def _compensated(self, weight: torch.Tensor, projection: torch.Tensor) -> tuple[NF4Parts, torch.Tensor]:
        """(Q(W'), B) minimizing ||W - deq(Q(W')) - s P B||: the paper's section 2.5.

        B = P^+ (W - deq(Q(W'))) / s solves for the residual in P's span; W' starts at W and becomes
        W - s P B, so the quantizer sees what B does not cover. The best of ``compensation_steps`` is kept.
        """
        pinv = torch.linalg.pinv(projection)
        current, best = weight, None
        for _ in range(self.compensation_steps):
            parts = nf4_quantize(current)
            residual = weight - nf4_dequantize(parts.packed, parts.absmax, parts.absmax_scale, parts.absmax_offset,
                                               weight.shape, torch.float32)
            b = (residual @ pinv if self.side == "input" else pinv @ residual) / self.scale
            update = self.scale * self.update_matrix(projection, b)
            error = torch.linalg.matrix_norm(residual - update).item()
            if best is None or error < best[0]:
                best = (error, parts, b)
            current = weight - update
        return best[1], best[2]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"scale={self.scale}, projection on the {self.side} side, bias={self.bias is not None}")


@dataclass
class _Probe:
    anchor: torch.Tensor  # requires grad, so that every probed layer's output does and backward reaches it
    calls: int = 0
    merged: bool = False


class _WeightGradient(torch.autograd.Function):
    """A LoQT layer during a gradient pass: forward as usual, backward merges with G = dY^T X."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor, layer: LoQTLinear) -> torch.Tensor:
        probe = layer._probe
        probe.calls += 1
        if probe.calls > 1:
            raise RuntimeError("a LoQT layer ran twice in one gradient pass; its merge needs the gradient of "
                               "exactly one use")
        ctx.layer = layer
        ctx.save_for_backward(x)
        return F.linear(x, layer.effective_weight(x.dtype), layer.bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (x,) = ctx.saved_tensors
        layer: LoQTLinear = ctx.layer
        weight = layer.effective_weight()
        grad_x = (grad.float() @ weight).to(x.dtype)
        gradient = grad.reshape(-1, layer.out_features).float().T @ x.reshape(-1, layer.in_features).float()
        layer.merge(weight, gradient)
        layer._probe.merged = True
        return grad_x, None, None


def loqt_layers(model: nn.Module) -> dict[str, LoQTLinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoQTLinear)}


def gradient_pass(model: nn.Module, gradient_loss: GradientLoss) -> None:
    """Merge every LoQT layer of ``model`` with W's gradient of ``gradient_loss(model)``, one layer at a time.

    The model's parameters are frozen for the pass (and restored), so no ``.grad`` changes.
    """
    layers = loqt_layers(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    device = next(iter(layers.values())).b.device
    anchor = torch.zeros((), device=device, requires_grad=True)
    try:
        for p in trainable:
            p.requires_grad_(False)
        for layer in layers.values():
            layer._probe = _Probe(anchor)
        loss = gradient_loss(model)
        unused = [name for name, layer in layers.items() if layer._probe.calls == 0]
        if unused:
            raise RuntimeError(f"gradient_loss did not run LoQT layers {', '.join(unused)}; a merge needs their "
                               "gradients (call the model it receives, not a compiled copy)")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"gradient_loss must return a scalar loss tensor; got {type(loss).__name__}")
        loss.backward()
        missed = [name for name, layer in layers.items() if not layer._probe.merged]
        if missed:
            raise RuntimeError(f"the loss does not depend on LoQT layers {', '.join(missed)}")
    finally:
        for layer in layers.values():
            layer._probe = None
        for p in trainable:
            p.requires_grad_(True)


def convert(model: nn.Module, config: LoQTConfig, gradient_loss: GradientLoss) -> nn.Module:
    """Replace ``model``'s chosen linears by LoQT linears in place and return it.

    Each gets P from W's gradient on ``gradient_loss(model)`` (one batch), W stored NF4 with B compensating
    its quantization error. Other parameters keep their ``requires_grad``: freeze them first to train only B.
    """
    targets = {name: module for name, module in model.named_modules() if config.selects(name, module)}
    if not targets:
        linears = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        shown = ", ".join(linears[:8]) + (", ..." if len(linears) > 8 else "")
        raise ValueError(f"no nn.Linear matches target {config.target!r}; the model's linears: {shown or 'none'}")
    for name, linear in targets.items():
        if config.rank > min(linear.in_features, linear.out_features):
            raise ValueError(f"rank {config.rank} exceeds {name}'s smaller dimension "
                             f"({linear.out_features} x {linear.in_features})")
    for name, linear in targets.items():
        model.set_submodule(name, LoQTLinear.from_linear(linear, config))
    gradient_pass(model, gradient_loss)
    return model


class LoQT:
    """Counts ``optimizer.step()`` calls and, after each scheduled one, merges every LoQT layer of ``model``.

    Counting optimizer steps (a hook on the optimizer) makes gradient accumulation correct: micro-batches
    never advance the schedule. A merge runs ``gradient_loss(model)`` once (forward and backward, uncompiled)
    and resets B's optimizer state.
    """

    def __init__(self, model: nn.Module, config: LoQTConfig, optimizer: torch.optim.Optimizer,
                 gradient_loss: GradientLoss) -> None:
        self.layers = loqt_layers(model)
        if not self.layers:
            raise ValueError("the model has no LoQT layers; convert it first: fxmem.train.convert(model, config, "
                             "gradient_loss)")
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        untrained = [name for name, layer in self.layers.items() if id(layer.b) not in trained]
        if untrained:
            raise ValueError(f"the optimizer does not train B of {', '.join(untrained[:4])}"
                             f"{', ...' if len(untrained) > 4 else ''}; create it after convert()")
        self.model, self.config, self.optimizer, self.gradient_loss = model, config, optimizer, gradient_loss
        self.optimizer_steps = 0
        self.merges = 0
        self._hook = optimizer.register_step_post_hook(self._after_optimizer_step)

    @property
    def next_merge_step(self) -> int:
        return self.config.merge_step(self.merges + 1)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self.optimizer_steps += 1
        if self.optimizer_steps >= self.next_merge_step:
            self.merge()

    def merge(self) -> None:
        """Merge now: W <- Q(deq(W) + s P B), new P, compensating B, B's optimizer state reset."""
        gradient_pass(self.model, self.gradient_loss)
        for layer in self.layers.values():
            self.optimizer.state.pop(layer.b, None)
            layer.b.grad = None
        self.merges += 1

    def remove(self) -> None:
        """Stop merging (removes the optimizer hook)."""
        self._hook.remove()

    def state_dict(self) -> dict[str, int]:
        """The schedule's position; W, P and B are in the model's state_dict, B's moments in the optimizer's."""
        return {"optimizer_steps": self.optimizer_steps, "merges": self.merges}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.optimizer_steps, self.merges = int(state["optimizer_steps"]), int(state["merges"])


def weight_nbytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the LoQT layers' W, P and B, summed over layers."""
    layers = loqt_layers(model).values()
    return {"weight": sum(layer.weight.nbytes for layer in layers),
            "projection": sum(layer.projection.nbytes for layer in layers),
            "b": sum(layer.b.numel() * layer.b.element_size() for layer in layers)}
