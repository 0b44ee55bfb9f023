"""RunLoRA: each recognised LoRA linear of the joint graph in the forward and backward order the cost model picks.

Autograd's graph for y = x W^T + s (x A^T) B^T saves x A^T and associates its
gradients one way. This pass keeps every node whose association the chosen
order shares and inserts the others (fxmem/kernels/runlora.py writes the same
orders as plain torch):

    forward2   y = x (W + s B A)^T                 (forward1: as traced)
    dA "xtdy"  B^T (x^T G)^T, with G = s dY        (else (G B)^T x, as traced)
    dB "xtdy"  (x^T G)^T A^T                       (else G^T (x A^T), as traced)
    dX merged  dY (W + s B A)                      (else dY W + (G B) A, as traced)

x A^T and W + s B A are tagged must-recompute, so min-cut saves neither (W + s B A
is rebuilt in backward from the weights; x A^T from x, which is saved anyway and
once for q/k/v, which read the same x). Where the LoRA branch reads dropout(x),
or x cast to the adapters' dtype (PEFT's fp32 adapters on a bf16 model), "x" in
the LoRA products above is what the branch reads and only forward1 and the split
dX apply (see fxmem/cost_model/lora_orders.py). A LoRA linear this pass cannot
follow (frozen B, an unexpected backward) is left as traced and named in the
summary.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from fxmem.analysis.graph import aten, hint, is_view, storage_base, strip, tensor_val, users_through_views
from fxmem.analysis.lora import LoraLinear, find_lora_linears, matmul_operands
from fxmem.analysis.meta import LORA_REORDERED
from fxmem.cost_model.lora_orders import BACKWARD_ASSOCIATIONS, LoraShape, OrderChoice, choose_by_flops
from fxmem.cost_model.lora_timing import choose_by_time
from fxmem.fallback import unsupported
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState, joint_primals, tag_must_recompute
from fxmem.passes.saved_rewrite import call

MM = aten.mm.default


class UnsupportedLora(Exception):
    """This LoRA linear's graph is not the shape the pass rewrites; it stays as traced."""


@dataclass
class LoraBackward:
    """The autograd nodes of one LoRA linear's backward (None where that gradient is not computed)."""

    grad_lora: Node  # G = s dY, (n x o), what flows into the LoRA branch
    grad_b: Node  # G^T (x A^T)
    z1: Node  # G B
    grad_a: Node | None  # (G B)^T x
    grad_x_lora: Node | None  # (G B) A
    grad_x_base: Node | None  # dY W
    grad_y: Node | None  # dY (n x o), the left operand of dY W

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({"b"} | ({"a"} if self.grad_a is not None else set())
                         | ({"x"} if self.grad_x_base is not None else set()))


class RunLora(GraphPass):
    name = "runlora"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        params = joint_primals(graph)
        decisions: dict[tuple[LoraShape, str, str], int] = {}
        skipped: list[str] = []
        unsupported_loras: list[str] = []  # of the skipped, those no other pass took
        for lora in find_lora_linears(graph, params):
            if lora.base.meta.get(LORA_REORDERED):
                skipped.append(f"{lora.module or lora.xa.name} (output rebuilt in backward by lora_reorder "
                               f"({lora.base.meta[LORA_REORDERED]}))")
                continue
            try:
                backward = _find_backward(lora)
                shape = _shape(lora)
                choice = (choose_by_flops(shape, backward.needs) if state.config.runlora == "flops"
                          else choose_by_time(shape, backward.needs, tensor_val(lora.x).device))
                _rewrite(graph, lora, backward, choice)
            except UnsupportedLora as reason:
                skipped.append(f"{lora.module or lora.xa.name} ({reason})")
                unsupported_loras.append(skipped[-1])
                continue
            key = (shape, choice.forward, choice.backward)
            decisions[key] = decisions.get(key, 0) + 1
        graph.eliminate_dead_code()
        if not decisions and not skipped:
            return UNCHANGED
        parts = [f"{count}x n={s.tokens} {s.in_features}->{s.out_features} r={s.rank}: {fwd}/{bwd}"
                 for (s, fwd, bwd), count in decisions.items()]
        summary = f"{sum(decisions.values())} LoRA linear(s) reordered, x A^T recomputed, not saved ({'; '.join(parts)})"
        if skipped:
            summary += f"; left as traced: {', '.join(skipped)}"
            if unsupported_loras:
                unsupported(f"runlora: left as traced: {', '.join(unsupported_loras)}", state.config)
        return PassResult(bool(decisions), summary)


def _shape(lora: LoraLinear) -> LoraShape:
    x, y = tensor_val(matmul_operands(lora.base)[0]), tensor_val(lora.base)
    return LoraShape(hint(x.shape[0]), hint(x.shape[1]), hint(y.shape[1]), lora.rank, x.dtype,
                     adapter_dtype=tensor_val(lora.lora_a).dtype, dropout=lora.dropout)


def _mm_users(node: Node) -> list[Node]:
    return [u for u in users_through_views(node) if u.target is MM]


def _find_backward(lora: LoraLinear) -> LoraBackward:
    if lora.base.target is not MM and lora.base.target is not aten.addmm.default:
        raise UnsupportedLora(f"base matmul {lora.base.target}")
    x2d, _ = matmul_operands(lora.base)
    x_lora = matmul_operands(lora.xa)[0]  # x, or what the LoRA branch reads instead (dropout, a cast)
    n, o, r = tensor_val(x2d).shape[0], tensor_val(lora.base).shape[1], lora.rank
    grad_b = next((u for u in _mm_users(lora.xa) if u is not lora.xab and storage_base(u.args[1]) is lora.xa), None)
    if grad_b is None or not is_view(grad_b.args[0]):
        raise UnsupportedLora("no gradient for B")
    grad_lora = grad_b.args[0].args[0]  # grad_b = mm(G^T, x A^T)
    lora_b_t = matmul_operands(lora.xab)[1]
    z1 = next((u for u in grad_lora.users if u.target is MM and u.args[0] is grad_lora
               and strip(u.args[1]) is strip(lora_b_t)), None)
    if z1 is None or tuple(tensor_val(grad_lora).shape) != (n, o) or tensor_val(z1).shape[1] != r:
        raise UnsupportedLora("unexpected backward of the LoRA branch")
    lora_a_source = strip(matmul_operands(lora.xa)[1])
    grad_a = grad_x_lora = None
    for user in _mm_users(z1):
        if storage_base(user.args[1]) is storage_base(x_lora):
            grad_a = user
        elif storage_base(user.args[0]) is z1 and strip(user.args[1]) is lora_a_source:
            grad_x_lora = user
    weight_source = strip(matmul_operands(lora.base)[1])
    grad_x_base = next((u for u in _mm_users(weight_source) if u is not lora.base and strip(u.args[1]) is weight_source
                        and tensor_val(u).shape == tensor_val(x2d).shape), None)
    if (grad_x_base is None) != (grad_x_lora is None):
        raise UnsupportedLora("gradient of x found for one branch only")
    return LoraBackward(grad_lora=grad_lora, grad_b=grad_b, z1=z1, grad_a=grad_a, grad_x_lora=grad_x_lora,
                        grad_x_base=grad_x_base, grad_y=grad_x_base.args[0] if grad_x_base is not None else None)


def _merged_weight_t(graph: Graph, lora: LoraLinear) -> Node:
    """(W + s B A)^T = W^T + s A^T B^T, from the operands the traced matmuls use; rebuilt wherever needed."""
    weight_t, lora_a_t, lora_b_t = (matmul_operands(lora.base)[1], matmul_operands(lora.xa)[1],
                                    matmul_operands(lora.xab)[1])
    product = call(graph, MM, (lora_a_t, lora_b_t))
    scaled = call(graph, aten.mul.Tensor, (product, lora.scaling))
    merged = call(graph, aten.add.Tensor, (weight_t, scaled))
    tag_must_recompute((product, scaled, merged))
    return merged


def _rewrite(graph: Graph, lora: LoraLinear, backward: LoraBackward, choice: OrderChoice) -> None:
    # Checks before any edit, so that a refusal leaves the graph untouched.
    assoc_a, assoc_b, assoc_x = BACKWARD_ASSOCIATIONS[choice.backward]
    drop_lora_dx = None
    if assoc_x == "merged" and backward.grad_x_lora is not None:
        drop_lora_dx = _sum_without(backward.grad_x_lora)
    x_lora, lora_a_t = matmul_operands(lora.xa)
    lora_b_t = matmul_operands(lora.xab)[1]

    tag_must_recompute([lora.xa, *[u for u in lora.xa.users if is_view(u)]])
    if choice.forward == "forward2":
        with graph.inserting_before(lora.output):
            merged = _merged_weight_t(graph, lora)
            args = list(lora.base.args)
            args[-1] = merged
            output = call(graph, lora.base.target, tuple(args))
            for view in _views_between(lora.base, lora.output):
                output = call(graph, view.target, (output, *view.args[1:]))
        lora.output.replace_all_uses_with(output)
    if "xtdy" in (assoc_a, assoc_b):
        with graph.inserting_before(backward.grad_lora.next):  # inserting_after would reverse the two
            x_t = call(graph, aten.permute.default, (x_lora, [1, 0]))
            xt_g = call(graph, MM, (x_t, backward.grad_lora))  # x^T G, i x o
        if assoc_a == "xtdy" and backward.grad_a is not None:
            with graph.inserting_before(backward.grad_a):
                new = call(graph, MM, (lora_b_t, call(graph, aten.permute.default, (xt_g, [1, 0]))))
            backward.grad_a.replace_all_uses_with(new)
        if assoc_b == "xtdy":
            with graph.inserting_before(backward.grad_b):
                new = call(graph, MM, (call(graph, aten.permute.default, (xt_g, [1, 0])), lora_a_t))
            backward.grad_b.replace_all_uses_with(new)
    if drop_lora_dx is not None:
        add, other = drop_lora_dx
        with graph.inserting_before(backward.grad_x_base):
            merged = _merged_weight_t(graph, lora)
            new = call(graph, MM, (backward.grad_y, call(graph, aten.permute.default, (merged, [1, 0]))))
        backward.grad_x_base.replace_all_uses_with(new)
        add.replace_all_uses_with(other)


def _views_between(base: Node, output: Node) -> list[Node]:
    """The views from the base matmul to the add that joins the LoRA branch (outermost last)."""
    side = next(a for a in output.args if isinstance(a, Node) and storage_base(a) is base)
    chain = []
    while side is not base:
        chain.append(side)
        side = side.args[0]
    return chain[::-1]


def _sum_without(grad_x_lora: Node) -> tuple[Node, Node]:
    """The add that sums the LoRA branch's dX into the rest, and its other operand."""
    current = grad_x_lora
    while len(current.users) == 1 and is_view(next(iter(current.users))):
        current = next(iter(current.users))
    users = list(current.users)
    if len(users) != 1 or users[0].target is not aten.add.Tensor or len(users[0].args) != 2:
        raise UnsupportedLora("the LoRA branch's dX is not summed by one add")
    add = users[0]
    other = add.args[1] if add.args[0] is current else add.args[0]
    if not isinstance(other, Node) or tensor_val(other).shape != tensor_val(add).shape:
        raise UnsupportedLora("the LoRA branch's dX is summed with a broadcast")
    return add, other
