"""Give the chunked MLP and linears a bitsandbytes 4-bit base to read: each ``gemm_4bit`` product becomes
``linear(x, W)``, W the packed weight dequantized by bitsandbytes' own ops (analysis/nf4_bases.py).

Runs on the graph dynamo captured, before chunk_mlp and chunk_linears, when either is on. W is tagged
must-recompute (AOTAutograd copies the tag onto its joint nodes): backward dequantizes it again, as
bitsandbytes' own backward does, instead of saving a float weight. The same values as ``gemm_4bit``, which
dequantizes the same way inside (bitsandbytes' default kernel is exactly this), in the same dtype between the same
casts. A product with a bias, under autocast (a linear would run in autocast's dtype, gemm_4bit in its own), or
whose sum has no LoRA term the chunked ops take (dropout), is left as bitsandbytes runs it.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node

from fxmem.analysis.meta import EXAMPLE_VALUE, MODULE_STACK
from fxmem.analysis.nf4_bases import Nf4Base, find_nf4_bases
from fxmem.passes.manager import GraphPass, PassResult, PipelineState, eliminate_dead_code, tag_must_recompute

# bitsandbytes' nested quantization scales blocks of 256 absmax values (its gemm_4bit refuses any other)
_NESTED_BLOCKSIZE = 256


class DequantizeBases(GraphPass):
    name = "dequantize_bases"
    stage = "dynamo"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.dynamo.graph
        found, left = find_nf4_bases(graph)
        order = {node: position for position, node in enumerate(graph.nodes)}
        # with linear_chunk, where x is made: the weights of the linears that read x then all exist before any of
        # their outputs is read, and chunk_linears runs them as one op; else just before the product, so that
        # forward holds one at a time, as bitsandbytes does (a chunked MLP reads its three at once anyway)
        places = [(base, base.x if state.config.linear_chunk is not None else base.call.prev) for base in found]
        for base, at in places:
            weight = _dequantized_weight(graph, base, order, at)
            base.output.replace_all_uses_with(_linear(graph, base, weight))
        left_note = (f"; {left} left as bitsandbytes runs it (a bias, autocast, or no LoRA sum the chunked ops take: "
                     "dropout)") if left else ""
        if not found:
            return PassResult(False, f"no bitsandbytes 4-bit product (gemm_4bit){left_note}")
        eliminate_dead_code(graph)
        return PassResult(True, f"{len(found)} bitsandbytes 4-bit product(s) as a linear on the weight dequantized "
                                f"by bitsandbytes, recomputed in backward, for the chunked ops to read{left_note}")


def _linear(graph: Graph, base: Nf4Base, weight: Node) -> Node:
    """``linear(x, W)``, or ``linear(x.to(d), W).to(x's dtype)`` where the product computes in another dtype d (the
    form analysis/loss.py's matcher reads as a base computed between casts)."""
    output = base.output.meta[EXAMPLE_VALUE]
    with graph.inserting_before(base.output):
        if base.dtype == output.dtype:
            linear = graph.call_function(torch.nn.functional.linear, (base.x, weight))
            _describe(linear, base, output)
            return linear
        x = graph.call_method("to", (base.x, base.dtype))
        _describe(x, base, base.x.meta[EXAMPLE_VALUE].to(base.dtype))
        linear = graph.call_function(torch.nn.functional.linear, (x, weight))
        _describe(linear, base, output.to(base.dtype))
        back = graph.call_method("to", (linear, output.dtype))
        _describe(back, base, output)
        return back


def _dequantized_weight(graph: Graph, base: Nf4Base, order: dict[Node, int], at: Node) -> Node:
    """The float weight, from nodes each tagged must-recompute, inserted after ``at`` (or after the last of the
    graph's inputs and the weight's operands, if later)."""
    ops = torch.ops.bitsandbytes
    packed = base.packed
    # bitsandbytes views the packed weight just before its product, which may be after another linear of the same
    # input has been read: viewed again here
    view_again = packed.op == "call_method" and packed.target == "view" and packed.args[0].op == "placeholder"
    operands = [at, list(graph.find_nodes(op="placeholder"))[-1], packed.args[0] if view_again else packed,
                *(n for n in (base.absmax, base.absmax_8bit, base.absmax_code, base.absmax_offset)
                  if isinstance(n, Node))]
    with graph.inserting_before(max(operands, key=order.__getitem__).next):
        if view_again:
            packed = graph.call_method("view", packed.args)
            _describe(packed, base, base.packed.meta[EXAMPLE_VALUE])
        absmax = base.absmax
        if base.absmax_8bit is not None:
            scales = graph.call_function(ops.dequantize_blockwise.default, (
                base.absmax_8bit, base.absmax, base.absmax_code, _NESTED_BLOCKSIZE, torch.float32))
            _recomputed(scales, base)
            absmax = graph.call_function(torch.add, (scales, base.absmax_offset))
            _recomputed(absmax, base)
        weight = graph.call_function(ops.dequantize_4bit.default, (
            packed, absmax, base.blocksize, base.quant_type, list(base.shape), base.dtype))
        _recomputed(weight, base)
    return weight


def _describe(node: Node, base: Nf4Base, value: torch.Tensor) -> None:
    """What dynamo gives every node of its graph: the value it traced, and its module (the product's)."""
    node.meta[EXAMPLE_VALUE] = value
    node.meta[MODULE_STACK] = dict(base.call.meta.get(MODULE_STACK, {}))


def _recomputed(node: Node, base: Nf4Base) -> None:
    """A node of the weight: tagged must-recompute, its value the op run on its arguments' values."""
    tag_must_recompute([node])
    _describe(node, base, node.target(*torch.fx.node.map_arg(node.args, lambda n: n.meta[EXAMPLE_VALUE])))
