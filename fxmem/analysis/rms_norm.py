"""RMSNorms as HF's Llama family writes them, found in the graph dynamo captured (torch-level ops).

The pattern is ``weight * (u * rsqrt(u.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)``, ``u = x.to(torch.float32)``
(LlamaRMSNorm, and Mistral's, Qwen2's and others copied from it), over x of (batch, tokens, hidden). Every tensor
between x and the output must be used only inside the norm: the chunked op (kernels/chunked_rms_norm.py) makes none
of them. Norms of other forms (Gemma's ``1 + weight``, a fused ``rms_norm``, a norm over each head) are not
matched.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import hint
from fxmem.analysis.loss import cast_dtype, example_tensor

_RSQRTS = frozenset({torch.rsqrt})
_MULS = frozenset({operator.mul, torch.mul})
_ADDS = frozenset({operator.add, torch.add})
_POWS = frozenset({operator.pow, torch.pow})
_MEANS = frozenset({torch.mean})


@dataclass(frozen=True)
class RmsNorm:
    output: Node  # weight * the normalized x cast back to x's dtype
    x: Node
    weight: Node
    eps: float
    tokens: int  # x's rows (a dynamic count: its hint)
    hidden: int
    element_size: int


def find_rms_norms(graph: Graph) -> list[RmsNorm]:
    """Every RMSNorm of ``graph`` in Llama's form."""
    found = []
    for node in graph.nodes:
        if _is(node, "rsqrt", _RSQRTS):
            norm = _match(node)
            if norm is not None:
                found.append(norm)
    return found


def _is(node: object, method: str, functions: frozenset) -> bool:
    """``node`` calls the tensor method ``method`` or one of ``functions``."""
    if not isinstance(node, Node):
        return False
    return (node.op == "call_method" and node.target == method) or (node.op == "call_function"
                                                                     and node.target in functions)


def _only_user(node: Node) -> Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _other(product: Node, operand: Node) -> object:
    """The other operand of a two-operand product that reads ``operand``, or None."""
    if len(product.args) != 2 or product.kwargs or operand not in product.args:
        return None
    return product.args[1] if product.args[0] is operand else product.args[0]


def _match(rsqrt: Node) -> RmsNorm | None:
    shifted = rsqrt.args[0] if len(rsqrt.args) == 1 and not rsqrt.kwargs else None
    if not _is(shifted, "add", _ADDS) or len(shifted.args) != 2 or shifted.kwargs or len(shifted.users) != 1:
        return None
    variance, eps = shifted.args if isinstance(shifted.args[1], float) else shifted.args[::-1]
    if not isinstance(eps, float) or not _is_row_mean(variance):
        return None
    square = variance.args[0]
    if not (_is(square, "pow", _POWS) and len(square.args) == 2 and square.args[1] == 2 and not square.kwargs
            and len(square.users) == 1):
        return None
    upcast = square.args[0]
    normalized = _only_user(rsqrt)
    if not (isinstance(upcast, Node) and cast_dtype(upcast) is torch.float32 and normalized is not None
            and _is(normalized, "mul", _MULS) and _other(normalized, rsqrt) is upcast
            and set(upcast.users) == {square, normalized}):
        return None
    x, cast = upcast.args[0], _only_user(normalized)
    x_value = example_tensor(x)
    # (batch, tokens, hidden) or (tokens, hidden): a per-head norm (Qwen3's q_norm) would chunk heads, not tokens
    if x_value is None or x_value.dim() not in (2, 3) or cast is None or cast_dtype(cast) is not x_value.dtype:
        return None
    output = _only_user(cast)
    weight = _other(output, cast) if output is not None and _is(output, "mul", _MULS) else None
    weight_value, hidden = example_tensor(weight), hint(x_value.shape[-1])
    if weight_value is None or [hint(s) for s in weight_value.shape] != [hidden]:
        return None
    return RmsNorm(output=output, x=x, weight=weight, eps=eps, tokens=hint(x_value.numel()) // hidden, hidden=hidden,
                   element_size=x_value.element_size())


def _is_row_mean(node: object) -> bool:
    """``node`` is a mean over the last dimension, keeping it."""
    if not _is(node, "mean", _MEANS) or len(node.args) != 2 or node.kwargs != {"keepdim": True}:
        return False
    value, dim = example_tensor(node.args[0]), node.args[1]
    last = (-1, value.dim() - 1) if value is not None else (-1,)
    return dim in last or (isinstance(dim, list | tuple) and len(dim) == 1 and dim[0] in last)
