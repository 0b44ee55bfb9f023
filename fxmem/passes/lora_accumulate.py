"""Each LoRA sum base + s (x A^T) B^T computed by one ``addmm`` that adds the LoRA product into the frozen output.

PEFT writes a LoRA linear's output as ``base + lora_B(lora_A(x)) * s``. In an aten graph that is two products and
an element-wise add, and inductor computes the add inside the kernel that reads the sum (RoPE after q and k, the
SwiGLU after gate and up): the frozen output and the LoRA product both stay whole until that kernel runs. Two
full-width buffers per linear where one would do, and at long context those are the step's largest transients
(a layer's backward reading gate and up held four MLP-wide buffers besides its own).

``addmm(base, x A^T, B^T, alpha=s)`` adds the product into a copy of ``base`` as the GEMM writes it: the frozen
output is freed as soon as it is read, and the sum is one stored buffer. The values are the sum's to the rounding
of the GEMM's own accumulation (one rounding of the sum instead of three).

Which sums: a LoRA sum (analysis/lora.py) whose frozen side is a matmul and whose two products and add share a dtype
and a row-major (tokens, features) layout, in either graph. Backward has the same form in x's gradient through one
linear, dY W + s (dY B) A. A sum the fused epilogue kernels took (passes/fuse_epilogue.py) is gone by
then; a LoRA product run in half precision and widened (passes/lora_half_products.py) is not matched (its sum
adds in float32 what the product rounded to bf16). On a GPU inductor splits an fp32 addmm whose readers are all
element-wise back into a product and an add (its post-grad ``unfuse_bias_add_to_pointwise``), and keeps a bf16 or
fp16 one whole: there the pass holds for half-precision sums.
"""

from __future__ import annotations

from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from fxmem.analysis.graph import aten, tensor_val
from fxmem.analysis.lora import LoraSum, lora_sums, matmul_operands
from fxmem.passes.manager import GraphPass, PipelineState
from fxmem.passes.saved_rewrite import call

_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default})


class LoraAccumulate(GraphPass):
    name = "lora_accumulate"
    stage = "partitioned"

    def run(self, state: PipelineState) -> str:
        rewritten = 0
        for gm in (state.fw, state.bw):
            for node in list(gm.graph.find_nodes(op="call_function", target=aten.add.Tensor)):
                for joined in lora_sums(node):
                    frozen = _frozen_product(joined)
                    if frozen is not None:
                        _accumulate(gm.graph, joined, frozen)
                        rewritten += 1
                        break
            gm.graph.eliminate_dead_code()
        return f"{rewritten} LoRA sum(s) accumulated into the frozen output" if rewritten else ""


def _reshaped_from(node: Node) -> tuple[Node, list[Node]]:
    """The tensor ``node`` reshapes (itself if it reshapes none), and the reshapes from it to ``node`` in order."""
    chain = []
    while node.op == "call_function" and node.target in _RESHAPES:
        chain.append(node)
        node = node.args[0]
    return node, chain[::-1]


def _reshapes_to_product(operand: Node, product: Node) -> list[Node] | None:
    """The reshapes from ``product`` to ``operand``, in order, when ``operand`` is ``product`` through reshapes and
    multiplications by a constant alone (None otherwise): no slice, transpose or broadcast that would put the
    product's elements elsewhere than the frozen side's."""
    node, reshapes = operand, []
    while node is not product:
        if node.op != "call_function":
            return None
        if node.target in _RESHAPES:
            reshapes.append(node)
            node = node.args[0]
        elif node.target in (aten.mul.Tensor, aten.mul.Scalar) and sum(isinstance(a, Node) for a in node.args) == 1:
            node = next(a for a in node.args if isinstance(a, Node))
        else:
            return None
    return reshapes[::-1]


def _frozen_product(joined: LoraSum) -> Node | None:
    """The frozen side's matmul when the sum can be one addmm into it: both products row-major (tokens, features)
    of one shape and dtype, each reshaped to the add's shape and nothing else (so their elements line up)."""
    frozen, _ = _reshaped_from(joined.base)
    operand = _lora_operand(joined)
    if {frozen.target, joined.product.target} != {aten.mm.default} or (
            _reshapes_to_product(operand, joined.product) is None):
        return None
    values = [tensor_val(n) for n in (frozen, joined.product, joined.base, operand, joined.add)]
    if any(v is None or not v.is_contiguous() for v in values) or len({v.dtype for v in values}) != 1:
        return None
    same = [(values[0], values[1]), (values[2], values[4]), (values[3], values[4])]
    if not all(statically_known_true(sym_eq(a.shape, b.shape)) for a, b in same):
        return None
    return frozen


def _lora_operand(joined: LoraSum) -> Node:
    return next(a for a in joined.add.args if a is not joined.base)


def _accumulate(graph: Graph, joined: LoraSum, frozen: Node) -> None:
    lhs, rhs = matmul_operands(joined.product)
    reshapes = _reshapes_to_product(_lora_operand(joined), joined.product)
    with graph.inserting_before(joined.add):
        out = call(graph, aten.addmm.default, (frozen, lhs, rhs), kwargs={"alpha": joined.scaling})
        for reshape in reshapes:  # the LoRA side's own reshapes, whose sizes are the graph's (symbolic) nodes
            out = call(graph, reshape.target, (out, *reshape.args[1:]), kwargs=dict(reshape.kwargs))
    joined.add.replace_all_uses_with(out)
    graph.erase_node(joined.add)
