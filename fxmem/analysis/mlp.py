"""SwiGLU MLPs with a PEFT LoRA on each linear, found in the graph dynamo captured (torch-level ops).

The pattern is Llama's ``down(silu(gate(x)) * up(x))``, each linear ``x W^T + scale (x A^T) B^T`` cast back to
x's dtype, as PEFT runs it. Every tensor between x and the down projection's output must be used only inside
the MLP: the chunked op (kernels/chunked_mlp.py) makes none of them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

from fxmem.analysis.graph import hint
from fxmem.analysis.loss import cast_dtype, example_tensor, peft_linear

_MULS = frozenset({operator.mul, torch.mul})
_SILUS = frozenset({torch.nn.functional.silu})


@dataclass(frozen=True)
class LoraLinearNodes:
    weight: Node
    a: Node
    b: Node
    scale: float


@dataclass(frozen=True)
class SwigluMlp:
    output: Node  # the down projection's output, cast back to x's dtype
    x: Node
    gate: LoraLinearNodes
    up: LoraLinearNodes
    down: LoraLinearNodes
    tokens: int  # x's rows (a dynamic count: its hint)
    width: int  # the MLP's intermediate width
    element_size: int


def find_swiglu_mlps(graph: Graph) -> list[SwigluMlp]:
    """Every SwiGLU MLP of ``graph`` whose linears all carry a PEFT LoRA on a frozen base weight."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _MULS and len(node.args) == 2 and not node.kwargs:
            mlp = _match(node)
            if mlp is not None:
                found.append(mlp)
    return found


def _uncast(node: object) -> object:
    """Through PEFT's ``.to(dtype)`` casts, to the value cast."""
    while isinstance(node, Node) and cast_dtype(node) is not None and len(node.users) == 1:
        node = node.args[0]
    return node


def lora_linear_of(output: object) -> tuple[Node, LoraLinearNodes] | None:
    """(x, the linear) of a LoRA linear whose output, cast or not, is ``output``; its base weight frozen."""
    if not isinstance(output, Node):
        return None
    found = peft_linear(output)
    if isinstance(found, str) or found[2] is None:
        return None
    x, weight, (a, b, scale) = found
    weight_value = example_tensor(weight)
    if weight_value is None or weight_value.requires_grad or not isinstance(x, Node):
        return None
    return x, LoraLinearNodes(weight, a, b, scale)


def adapter_keeps_its_dtype(linear: LoraLinearNodes) -> bool:
    """Whether the adapter's product x A^T comes out in A's dtype: not so under autocast, which the chunked ops do not
    reproduce (a float base shows it in its output's dtype; a 4-bit base, cast back explicitly, does not)."""
    a_value = example_tensor(linear.a)
    products = [user for user in linear.a.users if user.op == "call_function"]
    return a_value is not None and all(getattr(example_tensor(p), "dtype", None) == a_value.dtype for p in products)


def _match(product: Node) -> SwigluMlp | None:
    for activated, up_output in (product.args, product.args[::-1]):
        if not (isinstance(activated, Node) and activated.op == "call_function" and activated.target in _SILUS
                and len(activated.args) == 1 and not activated.kwargs and len(activated.users) == 1):
            continue
        gate_output, up_output = _uncast(activated.args[0]), _uncast(up_output)
        gate, up = lora_linear_of(gate_output), lora_linear_of(up_output)
        if gate is None or up is None or gate[0] is not up[0] or len(gate_output.users) != 1 \
                or len(up_output.users) != 1:
            continue
        down = _down_projection(product)
        if down is None:
            continue
        output, down_linear = down
        x, x_value, out_value = gate[0], example_tensor(gate[0]), example_tensor(output)
        if x_value is None or out_value is None or out_value.dtype != x_value.dtype \
                or not all(adapter_keeps_its_dtype(linear) for linear in (gate[1], up[1], down_linear)):
            continue
        width = int(example_tensor(down_linear.weight).shape[1])
        return SwigluMlp(output=output, x=x, gate=gate[1], up=up[1], down=down_linear,
                         tokens=hint(x_value.numel() // x_value.shape[-1]), width=width,
                         element_size=x_value.element_size())
    return None


def _down_projection(product: Node) -> tuple[Node, LoraLinearNodes] | None:
    """(output, linear) of the LoRA linear that is the product's only reader."""
    for user in product.users:
        total = user
        for _ in range(3):  # the base linear (between two casts where it computes in another dtype), then the add
            if len(total.users) != 1:
                break
            total = next(iter(total.users))
            down = lora_linear_of(total)
            if down is not None and down[0] is product and _only_down_reads(product, down[1]):
                cast = next(iter(total.users)) if len(total.users) == 1 else None
                return (cast if cast is not None and _uncast(cast) is total else total), down[1]
    return None


def _only_down_reads(product: Node, down: LoraLinearNodes) -> bool:
    """Every reader of the product is one of the down projection's two products (the LoRA's through a cast)."""
    for user in product.users:
        reader = next(iter(user.users)) if user.op == "call_method" and len(user.users) == 1 else user
        if not (reader.op == "call_function" and len(reader.args) >= 2 and reader.args[1] in (down.weight, down.a)):
            return False
    return True
