"""bitsandbytes 4-bit base weights under a PEFT LoRA, in the graph dynamo captured (torch-level ops).

bitsandbytes' ``Linear4bit`` runs its product as one op, ``bitsandbytes.gemm_4bit(x, packed, shape, absmax, ...)``,
which dequantizes the packed weight inside (the nested absmax too, ``absmax_8bit``) and multiplies. PEFT's LoRA on
it reads that product cast back to x's dtype and cloned, then adds the adapter's term. The chunked MLP and linears
(kernels/chunked_mlp.py, kernels/chunked_lora_linear.py) read a float weight; passes/dynamo/dequantize_bases.py gives them
one. Found here: each such product with no bias, its output cast back to its input's dtype (QLoRA's preparation keeps
the hidden states in float32 and ``bnb_4bit_compute_dtype`` is often bf16: the product then runs between two casts).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Graph, Node

from fxmem.analysis.loss import ADDS, cast_dtype, example_tensor, lora_delta


@dataclass(frozen=True)
class Nf4Base:
    call: Node  # the gemm_4bit call, or the autograd function's around it
    output: Node  # what PEFT adds the adapter's term to: the product through its casts and clone
    x: Node  # the input, before its cast to the computation dtype
    packed: Node
    shape: tuple[int, int]  # the weight's (out_features, in_features)
    absmax: Node  # the blocks' scales: float, or the nested quantization's scales when absmax_8bit is set
    blocksize: int
    quant_type: str  # "nf4" or "fp4"
    absmax_8bit: Node | None  # the nested (8-bit) scales, their code and offset (bitsandbytes' double quantization)
    absmax_code: Node | None
    absmax_offset: Node | None
    dtype: torch.dtype  # the computation dtype (bitsandbytes' compute_dtype); x's may differ


def find_nf4_bases(graph: Graph) -> tuple[list[Nf4Base], int]:
    """Every bias-free 4-bit product outside autocast, read through its cast back and PEFT's clone by a sum with a
    LoRA term of its input (no dropout: what the chunked ops take); and how many 4-bit products were left as they
    are. Two forms: ``gemm_4bit`` itself (bitsandbytes calls it directly where no
    input needs a gradient: the first block's q, k and v read the frozen embedding), and bitsandbytes' autograd
    function around it, which dynamo captures as ``autograd_function_apply`` with a forward body that is the one
    ``gemm_4bit``."""
    ops = getattr(torch.ops, "bitsandbytes", None)
    if ops is None or not hasattr(ops, "gemm_4bit"):
        return [], 0
    found, left = [], 0
    autocast = _under_autocast(graph)
    for node in graph.nodes:
        call = _gemm_call(node, ops.gemm_4bit.default) if node.op == "call_function" else None
        if call is None:
            continue
        base = None if node in autocast else _match(node, *call)
        if base is None:
            left += 1
        else:
            found.append(base)
    return found, left


def _under_autocast(graph: Graph) -> set[Node]:
    """The nodes dynamo captured inside an autocast region (one the compiled code enters): there ``linear`` would
    run in autocast's dtype, where ``gemm_4bit`` (no autocast kernel) runs in its computation dtype."""
    inside, depth = set(), 0
    for node in graph.nodes:
        if node.target is torch.amp.autocast_mode._enter_autocast:
            depth += 1
        elif node.target is torch.amp.autocast_mode._exit_autocast:
            depth -= 1
        elif depth:
            inside.add(node)
    return inside


_GEMM_ARGUMENTS = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit", "absmax_code",
                   "absmax_offset")


def _gemm_call(node: Node, gemm: torch._ops.OpOverload) -> tuple[dict[str, Any], Node] | None:
    """``gemm_4bit``'s arguments, as nodes of ``node``'s graph, and the node that is its product; or None where
    ``node`` is not a 4-bit product."""
    if node.target is gemm:
        return dict(zip(_GEMM_ARGUMENTS, node.args)) | dict(node.kwargs), node
    if node.target is not torch.ops.higher_order.autograd_function_apply:
        return None
    body_node = node.args[0]
    body = getattr(node.graph.owning_module, body_node.target, None) if isinstance(body_node, Node) else None
    inner = [n for n in body.graph.nodes if n.target is gemm] if isinstance(body, torch.fx.GraphModule) else []
    products = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
    if len(inner) != 1 or len(products) != 1 or _returned_first(body.graph) is not inner[0]:
        return None  # the body does more than the one product it returns
    outer = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[2:]))

    def outside(value: Any) -> Any:
        """The outer node a body argument is: a placeholder's, or that of the placeholder a view reshapes (the
        packed weight, viewed as bitsandbytes views it outside too)."""
        if not isinstance(value, Node):
            return value
        if value.op == "call_method" and value.target == "view" and value.args[0] in outer:
            return outer[value.args[0]]
        return outer.get(value)

    inside = dict(zip(_GEMM_ARGUMENTS, inner[0].args)) | dict(inner[0].kwargs)
    arguments = {name: outside(value) for name, value in inside.items()}
    if any(isinstance(value, Node) and arguments[name] is None for name, value in inside.items()):
        return None  # computed inside the body from something else
    return arguments, products[0]


def _returned_first(body: Graph) -> object:
    """What an autograd function's forward body returns first: ``((outputs...), (saved...))``."""
    returned = body.find_nodes(op="output")[0].args[0]
    outputs = returned[0] if isinstance(returned, (tuple, list)) and returned else None
    return outputs[0] if isinstance(outputs, (tuple, list)) and outputs else None


def _match(call: Node, args: dict[str, Any], product: Node) -> Nf4Base | None:
    x, packed, absmax = args["A"], args["B"], args["absmax"]
    if args.get("bias") is not None or not all(isinstance(n, Node) for n in (x, packed, absmax)):
        return None
    x_value = example_tensor(x)
    source = x.args[0] if cast_dtype(x) is not None else x  # Linear4bit's cast to its computation dtype
    source_value = example_tensor(source)
    if x_value is None or source_value is None or torch.is_autocast_enabled(x_value.device.type):
        return None  # autocast around the compiled call: dynamo captures no region for it
    output = product
    while len(output.users) == 1:  # the cast back to the input's dtype, then PEFT's defensive clone
        user = next(iter(output.users))
        if not (user.op == "call_method" and (user.target == "clone" and len(user.args) == 1 and not user.kwargs
                                              or cast_dtype(user) == source_value.dtype)):
            break
        output = user
    output_value = example_tensor(output)
    if len(output.users) != 1 or output_value is None or output_value.dtype != source_value.dtype:
        return None
    # read by PEFT's sum with a LoRA term of the same input, which the chunked ops take (not through dropout)
    total = next(iter(output.users))
    is_sum = total.op == "call_function" and total.target in ADDS and len(total.args) == 2
    others = [arg for arg in total.args if arg is not output] if is_sum else []
    if len(others) != 1 or lora_delta(others[0], source, output_value.dtype) is None:
        return None
    shape = args["shapeB"]
    return Nf4Base(call=call, output=output, x=source, packed=packed, shape=(int(shape[0]), int(shape[1])),
                   absmax=absmax, blocksize=int(args["blocksize"]), quant_type=str(args["quant_type"]),
                   absmax_8bit=args.get("absmax_8bit"), absmax_code=args.get("absmax_code"),
                   absmax_offset=args.get("absmax_offset"), dtype=x_value.dtype)
