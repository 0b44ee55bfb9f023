"""Norm units in a forward graph: the tensor a norm's backward saves, and the output the next linears read.

LoRAct's pre-norm sharing (section 3.3) saves only the output, which the
following linears save anyway, and rebuilds what the norm's backward needs
from it. Three forms are matched:

- RMSNorm as HF's Llama family writes it (the backward saves the input x and
  rstd): output = gamma * (x * rstd), so x = output / gamma / rstd; gamma a
  weight, or a weight plus a constant (Gemma's 1 + weight).
- LayerNorm decomposed by AOTAutograd (the backward saves x_hat = (x - mean)
  * rstd and rstd): output = x_hat * gamma (+ beta), so x_hat = (output -
  beta) / gamma.
- LayerNorm over x itself, as decomposed for a half-precision x upcast
  inside the norm (the backward saves x, mean and rstd; the output cast back
  to x's dtype): x = (output - beta) / gamma / rstd + mean.

This module finds the pieces; the planner decides and
``passes/saved_rewrite.rebuild_norm_input`` rewrites.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass

from torch.fx import Node

from fxmem.analysis.graph import DTYPE_CASTS, aten, original_op, tensor_args, tensor_val, walk_back

LAYER_NORMS = frozenset({"native_layer_norm", "layer_norm"})
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})


@dataclass(frozen=True)
class NormUnit:
    x: Node  # what the norm's backward saves: RMSNorm's input, LayerNorm's x_hat, or LayerNorm's x itself
    normalized: Node  # the normalized value that gamma scales, in the compute dtype
    rstd: Node | None  # 1 / sqrt(mean(x**2, -1) + eps) or 1 / sqrt(var + eps), one per row; None for x_hat
    gamma: Node  # the scale, of shape (hidden,): made from a graph input by casts and a constant added
    beta: Node | None  # LayerNorm's bias, of shape (hidden,): made from a graph input as gamma is
    output: Node  # normalized * gamma (+ beta), or its one cast: what the following linears read; x's shape or a
    # reshape of it (the rows flattened, or the last dimension split into heads), which the rebuild reshapes back
    mean: Node | None = None  # LayerNorm over x itself: each row's mean, added back after dividing by rstd


def _casts_of(node: Node) -> list[Node]:
    return [node] + [u for u in node.users if u.target in DTYPE_CASTS]


def _forms_of(x: Node) -> list[Node]:
    """``x``, its reshapes that keep the last dimension (OPT flattens the residual to rows before a norm) or split
    it into heads (Qwen3's and Gemma 3's per-head q and k norms), and the casts of each: what a norm over ``x`` may
    read."""
    shape = tensor_val(x).shape
    # a static shape only: the rebuild reshapes back to it, and a symbolic size has no value in backward's graph
    static = all(isinstance(size, int) for size in shape)
    reshapes = [u for u in x.users if static and u.target in RESHAPES and tensor_val(u) is not None
                and tensor_val(u).numel() == tensor_val(x).numel()
                and (tensor_val(u).shape[-1] == shape[-1] or _splits_last(shape, tensor_val(u).shape))]
    return [form for node in (x, *reshapes) for form in _casts_of(node)]


def _splits_last(shape: tuple[int, ...], reshaped: tuple[int, ...]) -> bool:
    """Whether ``reshaped`` is ``shape`` with its last dimension split in two (heads x head_dim)."""
    return (len(reshaped) == len(shape) + 1 and tuple(reshaped[:-2]) == tuple(shape[:-1])
            and reshaped[-2] * reshaped[-1] == shape[-1])


def _products(factors: list[Node]) -> Iterator[tuple[Node, Node]]:
    """(product, other factor) for every two-tensor ``mul`` that reads one of ``factors``."""
    for factor in factors:
        for product in factor.users:
            operands = tensor_args(product)
            if product.target is aten.mul.Tensor and len(operands) == 2 and factor in operands:
                yield product, operands[1] if operands[0] is factor else operands[0]


def _is_rstd_of(stat: Node, x_forms: list[Node]) -> bool:
    """``stat`` is rsqrt(mean(x**2, -1) + eps) for x one of ``x_forms`` (x and its casts)."""
    if stat.target is not aten.rsqrt.default:
        return False
    for producer in walk_back(stat, through=("add", "rsqrt"), depth=4):
        if producer.target is aten.mean.dim and producer.args[1] in ([-1], (-1,), [len(tensor_val(stat).shape) - 1]):
            square = producer.args[0]
            return (isinstance(square, Node) and square.target is aten.pow.Tensor_Scalar and square.args[1] == 2
                    and square.args[0] in x_forms)
    return False


def scale_source(scale: Node) -> tuple[Node, list[Node]] | None:
    """(weight, ops) where ``scale`` is a graph input ``weight``, or made from it alone by ``ops`` (first to last):
    casts and adding a constant (Gemma's RMSNorm scales by 1 + weight). Backward replays ``ops`` on the weight, a
    parameter it keeps for free. None if ``scale`` is made otherwise."""
    ops = []
    while scale.op == "call_function" and (scale.target in DTYPE_CASTS or _adds_a_constant(scale)):
        ops.append(scale)
        scale = tensor_args(scale)[0]
    return (scale, ops[::-1]) if scale.op == "placeholder" else None


def _adds_a_constant(node: Node) -> bool:
    return (node.target in (aten.add.Tensor, aten.add.Scalar) and not node.kwargs and len(tensor_args(node)) == 1
            and isinstance(node.args[1 if node.args[0] is tensor_args(node)[0] else 0], int | float))


def _is_weight(node: Node, width: int) -> bool:
    """``node`` is a (width,) scale made from a graph input alone (``scale_source``)."""
    val = tensor_val(node)
    return val is not None and val.dim() == 1 and val.shape[0] == width and scale_source(node) is not None


def _scaled_output(normalized: Node, x: Node) -> tuple[Node, Node, Node | None] | None:
    """(output, gamma, beta) for output = normalized * gamma (+ beta), through casts; None if not so."""
    width = tensor_val(normalized).shape[-1]  # the norm's, a head's where it reads x split into heads
    for scaled, gamma in _products(_casts_of(normalized)):
        if not _is_weight(gamma, width):
            continue
        output, beta = scaled, None
        shifts = [u for u in scaled.users if u.target is aten.add.Tensor and len(tensor_args(u)) == 2]
        if len(scaled.users) == 1 and len(shifts) == 1:
            other = [a for a in tensor_args(shifts[0]) if a is not scaled]
            if len(other) == 1 and _is_weight(other[0], width):
                output, beta = shifts[0], other[0]
        # the linears read the output through one cast: a norm computed in float32 over a half-precision x, cast
        # back to x's dtype; or autocast's cast of a float32 model's norm output to its compute dtype
        casts = [u for u in output.users if _is_dtype_cast(u)]
        if len(casts) == 1 and len(output.users) == 1:
            output = casts[0]
        out_val, x_val = tensor_val(output), tensor_val(x)
        if out_val.shape[-1] == width and out_val.numel() == x_val.numel():  # the shape of the form it read
            return output, gamma, beta
    return None


def _is_dtype_cast(node: Node) -> bool:
    """A copy that changes the dtype and nothing else (not the device, not the layout)."""
    return node.target in DTYPE_CASTS and set(node.kwargs) <= {"dtype"}


def _layer_norm_of_x(x_forms: list[Node], x: Node) -> NormUnit | None:
    """The LayerNorm over ``x`` itself (its forms: x and its casts), as decomposed where backward saves x (a
    half-precision x): ((x - mean) * rstd) * gamma + beta, mean and rsqrt(var + eps) from one var_mean over the last
    dimension."""
    for form in x_forms:
        for centered in form.users:
            if centered.target is not aten.sub.Tensor or centered.args[0] is not form:
                continue
            stats = _row_var_mean(centered.args[1], form)
            if stats is None:
                continue
            for normalized, rstd in _products([centered]):
                if rstd.target is not aten.rsqrt.default or not any(
                        p.target is operator.getitem and p.args == (stats, 0)
                        for p in walk_back(rstd, through=(aten.rsqrt.default, aten.add.Tensor), depth=3)):
                    continue
                found = _scaled_output(normalized, x)
                if found is not None:
                    output, gamma, beta = found
                    return NormUnit(x=x, normalized=normalized, rstd=rstd, gamma=gamma, beta=beta, output=output,
                                    mean=centered.args[1])
    return None


def _row_var_mean(mean: object, form: Node) -> Node | None:
    """The var_mean over ``form``'s last dimension whose mean ``mean`` is; None if it is not one."""
    if not (isinstance(mean, Node) and mean.target is operator.getitem and mean.args[1] == 1):
        return None
    stats = mean.args[0]
    last = (-1, tensor_val(form).dim() - 1)
    if (stats.target is aten.var_mean.correction and stats.args[0] is form and len(stats.args) > 1
            and isinstance(stats.args[1], list | tuple) and list(stats.args[1]) in ([d] for d in last)):
        return stats
    return None


def norm_unit(x: Node) -> NormUnit | None:
    """The norm whose backward saves ``x`` (a storage base) and whose scaled output is a separate tensor; None if
    ``x`` is no such thing. Fused ``rms_norm`` / ``layer_norm`` ops (not decomposed) are not matched."""
    x_val = tensor_val(x)
    if x_val is None or x_val.dim() < 2 or not x_val.dtype.is_floating_point:
        return None
    if original_op(x) in LAYER_NORMS:  # x is x_hat
        found = _scaled_output(x, x)
        if found is not None:
            output, gamma, beta = found
            return NormUnit(x=x, normalized=x, rstd=None, gamma=gamma, beta=beta, output=output)
        return None
    x_forms = _forms_of(x)
    for normalized, rstd in _products(x_forms):
        if not _is_rstd_of(rstd, x_forms):
            continue
        found = _scaled_output(normalized, x)
        if found is not None and found[2] is None:
            return NormUnit(x=x, normalized=normalized, rstd=rstd, gamma=found[1], beta=None, output=found[0])
    return _layer_norm_of_x(x_forms, x)
