"""The LM head and its cross-entropy, found in the graph dynamo captured (torch-level ops, before AOTAutograd).

There the loss is one ``F.cross_entropy`` call with its options, and the head one ``F.linear`` (two more and a
sum for a PEFT LoRA on the head): the pattern is matched before AOTAutograd decomposes it into some twenty aten
ops in forward and as many in backward. A loss that is not of the form fxmem chunks is reported with the reason.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxmem.analysis.graph import hint

_LINEARS = frozenset({torch._C._nn.linear, torch.nn.functional.linear})
ADDS = frozenset({operator.add, operator.iadd, torch.add})
_MULS = frozenset({operator.mul, operator.imul, torch.mul})
# Methods and functions that only reshape or cast the logits on their way to the loss.
_SHAPE_METHODS = frozenset({"view", "reshape", "float", "to", "contiguous", "flatten"})
_SHAPE_FUNCTIONS = frozenset({torch.reshape, torch.flatten})
_CROSS_ENTROPY_SIGNATURE = inspect.signature(torch.nn.functional.cross_entropy)


@dataclass(frozen=True)
class HeadLoss:
    """``cross_entropy(linear(x, weight) [+ LoRA], target)`` with the logits used by nothing else."""

    loss: Node  # the cross_entropy call
    x: Node  # the head's input, (..., hidden)
    weight: Node  # (vocabulary, hidden)
    target: Node  # (tokens,)
    lora: tuple[Node, Node, float] | None  # PEFT's A (rank, hidden), B (vocabulary, rank) and scale
    ignore_index: int
    reduction: str
    logits_dtype: torch.dtype
    tokens: int  # a dynamic count: its hint, the count dynamo traced with
    vocab: int
    hidden: int
    element_size: int  # of the head's input
    head_trains: bool  # the head's weight takes a gradient, or the head has a LoRA
    device_type: str
    logits_outputs: tuple[Node, ...]  # logits nodes that are also forward outputs (kept unless dropped)


@dataclass(frozen=True)
class UnchunkedLoss:
    loss: Node
    reason: str


def find_head_losses(graph: Graph) -> list[HeadLoss | UnchunkedLoss]:
    """Every cross-entropy of ``graph``, matched or with the reason it is not."""
    return [_match(node) for node in graph.nodes
            if node.op == "call_function" and node.target is torch.nn.functional.cross_entropy]


def example_tensor(node: object) -> torch.Tensor | None:
    """The tensor dynamo traced ``node`` with, or None for anything else."""
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _match(loss: Node) -> HeadLoss | UnchunkedLoss:
    def unchunked(reason: str) -> UnchunkedLoss:
        return UnchunkedLoss(loss, reason)

    bound = _CROSS_ENTROPY_SIGNATURE.bind(*loss.args, **loss.kwargs)
    bound.apply_defaults()
    options = bound.arguments
    if options["label_smoothing"] != 0.0:
        return unchunked("label smoothing")
    if options["weight"] is not None:
        return unchunked("class weights")
    if options["size_average"] is not None or options["reduce"] is not None:
        return unchunked("the deprecated size_average / reduce arguments")
    if options["reduction"] not in ("mean", "sum"):
        return unchunked(f"reduction {options['reduction']!r} (a loss per token)")
    logits, target = example_tensor(options["input"]), example_tensor(options["target"])
    if logits is None or target is None or logits.dim() != 2 or target.dim() != 1 or target.dtype != torch.long:
        return unchunked("not (tokens, vocabulary) logits against class indices")
    if not isinstance(options["ignore_index"], int):
        return unchunked("an ignore_index that is not a constant")

    node, child, outputs = options["input"], loss, []
    while True:
        for user in node.users:
            if user.op == "output":
                outputs.append(node)
            elif user is not child:
                return unchunked(f"the logits also feed {_describe(user)} (soft-capping, a z-loss or another use)")
        if not _is_reshape_or_cast(node):
            break
        node, child = node.args[0], node
    head = peft_linear(node)
    if isinstance(head, str):
        return unchunked(head)
    x, weight, lora = head
    x_value, weight_value = example_tensor(x), example_tensor(weight)
    if x_value is None or weight_value is None or x_value.dtype != weight_value.dtype:
        return unchunked("the head's input and weight differ in dtype")
    if lora is not None and any(getattr(example_tensor(n), "dtype", None) != x_value.dtype for n in lora[:2]):
        return unchunked("the head's LoRA factors differ in dtype from its input")
    vocab, hidden = weight_value.shape
    if not (statically_known_true(logits.shape[1] == vocab)
            and statically_known_true(math.prod(x_value.shape[:-1]) == logits.shape[0])):
        return unchunked("the logits are reshaped across tokens before the loss")
    return HeadLoss(loss=loss, x=x, weight=weight, target=options["target"], lora=lora,
                    ignore_index=options["ignore_index"], reduction=options["reduction"], logits_dtype=logits.dtype,
                    tokens=hint(logits.shape[0]), vocab=int(vocab), hidden=int(hidden),
                    element_size=x_value.element_size(), head_trains=weight_value.requires_grad or lora is not None,
                    device_type=x_value.device.type, logits_outputs=tuple(outputs))


def cast_dtype(node: Node) -> torch.dtype | None:
    """The dtype of a ``.to(dtype)`` or ``.to(dtype=dtype)`` cast (PEFT writes both), else None: ``.to(device)``,
    ``.to(other_tensor)`` or a copy move data."""
    if node.op != "call_method" or node.target != "to":
        return None
    if len(node.args) == 2 and not node.kwargs:
        dtype = node.args[1]
    elif len(node.args) == 1 and list(node.kwargs) == ["dtype"]:
        dtype = node.kwargs["dtype"]
    else:
        return None
    return dtype if isinstance(dtype, torch.dtype) else None


def _is_reshape_or_cast(node: Node) -> bool:
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return node.target != "to" or cast_dtype(node) is not None
    return node.op == "call_function" and node.target in _SHAPE_FUNCTIONS


def _describe(node: Node) -> str:
    return f"{node.target}" if node.op == "call_method" else getattr(node.target, "__name__", str(node.target))


def _linear(node: Node) -> tuple[Node, Node] | str:
    """(x, weight) of a bias-free linear node, or why not."""
    if node.op != "call_function" or node.target not in _LINEARS:
        return (f"the logits come from {_describe(node)}, not straight from a linear head (soft-capping, scaling "
                "or another op between)")
    x, weight, *rest = [*node.args, *node.kwargs.values()]
    if rest and rest[0] is not None:
        return "the head has a bias"
    return x, weight


def peft_linear(node: Node) -> tuple[Node, Node, tuple[Node, Node, float] | None] | str:
    """(x, weight, LoRA (A, B, scale) or None) of the bias-free linear, PEFT's LoRA on it or not, whose output
    ``node`` is; or why not (as the head of a loss: the reason names the logits)."""
    if node.op == "call_function" and node.target in ADDS and len(node.args) == 2 and not node.kwargs:
        for base, delta in (node.args, node.args[::-1]):
            if not isinstance(base, Node) or len(base.users) != 1 or isinstance(linear := _base_linear(base), str):
                continue
            lora = lora_delta(delta, linear[0], getattr(example_tensor(base), "dtype", None))
            if lora is not None:
                return (*linear, lora)
        return "the logits are a sum that is not a PEFT LoRA on the head"
    linear = _linear(node)
    return linear if isinstance(linear, str) else (*linear, None)


def base_computes_cast(node: Node) -> bool:
    """Whether ``node`` is a linear computed in another dtype between two explicit casts, ``linear(x.to(d),
    W).to(x's dtype)``: a bitsandbytes 4-bit base as passes/dynamo/dequantize_bases.py writes it."""
    if cast_dtype(node) is None or not isinstance(node.args[0], Node) or len(node.args[0].users) != 1:
        return False
    inner = _linear(node.args[0])
    if isinstance(inner, str) or not isinstance(inner[0], Node) or cast_dtype(inner[0]) is None:
        return False
    source = example_tensor(inner[0].args[0]) if isinstance(inner[0].args[0], Node) else None
    return source is not None and source.dtype == cast_dtype(node)


def _base_linear(node: Node) -> tuple[Node, Node] | str:
    """(x, weight) of a bias-free linear, or of one computed between two casts (``base_computes_cast``), x then
    the value before its cast."""
    if base_computes_cast(node):
        x, weight = _linear(node.args[0])
        return x.args[0], weight
    return _linear(node)


def lora_delta(node: object, x: Node, base_dtype: torch.dtype | None) -> tuple[Node, Node, float] | None:
    """(A, B, scale) if ``node`` is PEFT's ``lora_B(lora_A(x)) * scale`` of the input ``x``, else None; cast to the
    base's dtype ``base_dtype`` or not (PEFT's LoRA on a bitsandbytes 4-bit base casts it before the sum)."""
    if isinstance(node, Node) and cast_dtype(node) is not None and len(node.users) == 1:
        if cast_dtype(node) != base_dtype:
            return None
        node = node.args[0]
    if not isinstance(node, Node) or node.op != "call_function" or node.target not in _MULS or len(node.users) != 1:
        return None
    product, scale = node.args if isinstance(node.args[1], (int, float)) else node.args[::-1]
    if not isinstance(scale, (int, float)) or not isinstance(product, Node):
        return None
    down = _linear(product) if len(product.users) == 1 else "used elsewhere"
    if isinstance(down, str) or not isinstance(down[0], Node) or len(down[0].users) != 1:
        return None
    up = _linear(down[0])
    if isinstance(up, str):
        return None
    lora_x, a = up
    b = down[1]
    # PEFT casts the input to the factors' dtype: the same tensor when the dtypes agree (checked by the caller)
    while isinstance(lora_x, Node) and lora_x is not x and cast_dtype(lora_x) is not None:
        lora_x = lora_x.args[0]
    return (a, b, float(scale)) if lora_x is x else None
