"""Why a saved tensor is saved: its role, read from the aten graph alone.

Each rule looks at the tensor's storage, what the forward does with it and what
the backward uses it for (``original_aten`` names the op a primitive was
decomposed from, so silu or layer_norm survive inductor's decompositions).
Model-class names are never consulted, so the roles hold for any transformer.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum

import torch
from torch.fx import Node

from fxmem.analysis.graph import (
    DTYPE_CASTS,
    aten,
    is_floating,
    is_reduced_shape,
    is_view,
    module_path,
    numel_hint,
    original_op,
    schema_name,
    storage_base,
    strip,
    tensor_args,
    tensor_val,
    users_through_views,
    walk_back,
)
from fxmem.analysis.lora import MATMULS, LoraLinear, matmul_operands
from fxmem.analysis.meta import LORA_REORDERED
from fxmem.analysis.ops import (
    ACTIVATION_BACKWARDS,
    ACTIVATIONS,
    BATCHED_MATMULS,
    CHUNKED_LINEARS,
    CHUNKED_MLP,
    CHUNKED_NORM,
    GROUPED_MATMULS,
    LOG_SOFTMAXES,
    LOSS_OPS,
    NONLINEAR_POINTWISE,
    NORM_BACKWARDS,
    NORMS,
    SOFTMAXES,
    is_fused_attention,
)


class Role(str, Enum):
    LINEAR_INPUT = "linear_input"
    LORA_INTERMEDIATE = "lora_intermediate"
    LORA_BASE_OUTPUT = "lora_base_output"
    NORM_INPUT = "norm_input"
    ACT_INPUT = "act_input"
    PRODUCT_INPUT = "product_input"
    ROW_SCALED = "row_scaled"
    ATTN_QKV = "attn_qkv"
    ATTN_PROBS = "attn_probs"
    ROUTER = "router"
    ATTN_OUT = "attn_out"
    ATTN_MASK = "attn_mask"
    ROPE_TABLE = "rope_table"
    LOSS_INPUT = "loss_input"
    LOSS_GRADIENT = "loss_gradient"
    DROPOUT_MASK = "dropout_mask"
    SMALL = "small"
    INDEX = "index"
    INPUT_VIEW = "input_view"
    PARAMETER = "parameter"
    UNKNOWN = "unknown"


# Roles of tensors that exist anyway: compressing them frees nothing.
FREES_NOTHING = frozenset({Role.PARAMETER, Role.INPUT_VIEW})

ROLE_DESCRIPTIONS = {
    Role.LINEAR_INPUT: "input of a linear layer, kept for its weight's (or LoRA A's) gradient",
    Role.LORA_INTERMEDIATE: "x @ A of a LoRA linear (rank r), kept for B's gradient",
    Role.LORA_BASE_OUTPUT: "x @ W of a LoRA linear whose output backward rebuilds as x W + s (x A) B (lora_reorder)",
    Role.NORM_INPUT: "input, or normalized input, of a LayerNorm/RMSNorm",
    Role.ACT_INPUT: "input (or precomputed derivative) of an activation function",
    Role.PRODUCT_INPUT: "operand of an elementwise product of two activations (SwiGLU's up * act(gate))",
    Role.ROW_SCALED: "x in x * s, s one value per row (an expert's output times its routing weight): kept only for "
                     "s's gradient, a sum over each row",
    Role.ATTN_QKV: "query, key or value of attention",
    Role.ATTN_PROBS: "attention scores or probabilities (eager attention)",
    Role.ROUTER: "a mixture-of-experts router's logits, probabilities or chosen weights: a top-k or sort picks from "
                 "them, so backward must see forward's values",
    Role.ATTN_OUT: "fused attention's output or log-sum-exp",
    Role.ATTN_MASK: "mask or bias added to attention scores",
    Role.ROPE_TABLE: "rotary-embedding cos/sin table",
    Role.LOSS_INPUT: "logits kept for the cross-entropy backward, or what the loss's input follows from",
    Role.LOSS_GRADIENT: "a gradient of the chunked loss (LM head input, weight or LoRA), computed in forward",
    Role.DROPOUT_MASK: "dropout keep-mask",
    Role.SMALL: "per-row statistic or scalar (norm rstd, softmax max/sum, loss scale)",
    Role.INDEX: "integer or boolean tensor (labels, masks, indices)",
    Role.INPUT_VIEW: "a graph input or a view of one: compressing it frees nothing",
    Role.PARAMETER: "a parameter or buffer, or a view of one: not an activation",
    Role.UNKNOWN: "saved for a reason no rule recognises",
}

@dataclass
class TensorFacts:
    node: Node  # the saved forward node
    base: Node  # the node that allocated its storage
    fw_users: list[Node]  # forward users of the storage, through views
    bw_users: list[Node]  # backward users of the saved tensor, through views
    params: frozenset[Node]
    inputs: frozenset[Node]
    lora_by_xa: dict[Node, LoraLinear]
    fw_nodes: dict[str, Node]  # forward nodes by name: min-cut gives a recomputed node its forward name
    saved_bases: frozenset[Node] = frozenset()  # storages of every saved tensor of the region

    @property
    def val(self) -> torch.Tensor:
        return tensor_val(self.node)

    def fw_ops(self) -> set[str]:
        return {original_op(u) for u in self.fw_users}

    def bw_ops(self) -> set[str]:
        return {original_op(u) for u in self.bw_users}


Match = tuple[Role, str]


def _parameter(f: TensorFacts) -> Match | None:
    if f.base in f.params:
        return Role.PARAMETER, f.base.name
    if f.base in f.inputs:
        return Role.INPUT_VIEW, f.base.name
    return None


def _dropout_mask(f: TensorFacts) -> Match | None:
    if f.val.dtype == torch.bool and (original_op(f.base) == "native_dropout"
                                     or "native_dropout_backward" in f.bw_ops()):
        return Role.DROPOUT_MASK, ""
    return None


def _loss_gradient(f: TensorFacts) -> Match | None:
    base = f.base
    if base.target is operator.getitem and isinstance(base.args[0], Node) \
            and original_op(base.args[0]) == "linear_cross_entropy":
        return Role.LOSS_GRADIENT, ("", "head input", "head weight", "head LoRA A", "head LoRA B")[base.args[1]]
    return None


def _fused_attention(f: TensorFacts) -> Match | None:
    base = f.base
    if base.target is operator.getitem:
        parent = base.args[0]
        if isinstance(parent, Node) and is_fused_attention(parent):
            index = base.args[1]
            if index == 0:
                return Role.ATTN_OUT, "output"
            if index == 1:
                return Role.ATTN_OUT, "log-sum-exp"
            return Role.SMALL, f"attention state #{index}"
    # Backward users count too: attention that backward recomputes reads the saved q, k, v there.
    for user, storage in [(u, base.name) for u in f.fw_users] + [(u, f.node.name) for u in f.bw_users]:
        operands, forward = _attention_operands(user)
        for position, arg in enumerate(operands):
            if isinstance(arg, Node) and storage_base(arg).name == storage:
                if position < 3:
                    return Role.ATTN_QKV, "qkv"[position]
                if forward:
                    return Role.ATTN_MASK, ""
    return None


def forward_attention_operands(node: Node) -> list:
    """(q, k, v, ...) of a fused attention forward, as it is or run under recompute_attention's RNG wrapper."""
    if node.target is torch.ops.higher_order.run_and_save_rng_state and "scaled_dot_product" in str(node.args[0]):
        return list(node.args[1:]) + list(node.kwargs.values())  # (op, *operands)
    operands, forward = _attention_operands(node)
    return operands if forward else []


def _attention_operands(node: Node) -> tuple[list, bool]:
    """(q, k, v, ...) of a fused attention forward, its recomputation or its backward; bool: a forward."""
    if is_fused_attention(node):
        return list(node.args) + list(node.kwargs.values()), True
    if node.target is torch.ops.higher_order.run_with_rng_state and "scaled_dot_product" in str(node.args[1]):
        return list(node.args[2:]) + list(node.kwargs.values()), True  # (rng state, op, *operands)
    name = original_op(node)
    if "scaled_dot_product" in name and "backward" in name:
        return list(node.args[1:4]), False  # (grad_out, q, k, v, out, ...)
    return [], False


# The discrete choices of a mixture-of-experts router: which experts a token goes to.
ROUTING_CHOICES = frozenset({"topk", "sort", "argsort", "argmax"})
# What lies between a router's logits and its top-k: scale, bias, softmax or sigmoid (decomposed or not), casts.
_TO_ROUTING = frozenset({"add", "sub", "mul", "div", "sigmoid", "exp", "sum", "amax"}) | SOFTMAXES


def _router(f: TensorFacts) -> Match | None:
    """A router's scores, values a top-k (or sort, argmax) chooses from through casts, views and element-wise ops
    (its softmax or sigmoid, a bias), or the chosen values themselves (renormalized, or gpt-oss's softmax over them).
    Before attention's rules: a router's softmax is no attention's."""
    if not f.val.dtype.is_floating_point:
        return None
    if _feeds(f.base, ROUTING_CHOICES, through=_TO_ROUTING, depth=12):
        return Role.ROUTER, "scores a top-k chooses from"
    if any(p.target is operator.getitem and isinstance(p.args[0], Node) and original_op(p.args[0]) in
           ROUTING_CHOICES for p in walk_back(f.base, through=("div", "mul", "sum", "add", *SOFTMAXES), depth=6)):
        return Role.ROUTER, "the chosen experts' weights"
    return None


def _eager_attention(f: TensorFacts) -> Match | None:
    """q/k/v and probabilities of attention written as matmul + softmax + matmul."""
    if is_reduced_shape(f.val):
        return None
    if from_softmax(f.base):
        return Role.ATTN_PROBS, "probabilities"
    if _feeds(f.base, SOFTMAXES):
        return Role.ATTN_PROBS, "scores (softmax input)"
    for user in f.fw_users:
        operand = eager_attention_operand(user, f.base)
        if operand is not None:
            return Role.ATTN_QKV, operand
    return None


def eager_attention_operand(matmul: Node, storage: Node) -> str | None:
    """'q', 'k' or 'v' if ``matmul`` is eager attention's scores (q k^T) or output (P v) matmul and reads
    ``storage`` as that operand; else None."""
    if matmul.target not in BATCHED_MATMULS:
        return None
    lhs, rhs = matmul_operands(matmul)
    if from_softmax(lhs) and storage_base(rhs) is storage:
        return "v"
    if _feeds(matmul, SOFTMAXES):
        return "q" if storage_base(lhs) is storage else "k"
    return None


# What lies between a per-head norm's input and attention's operand: the norm (its products with rstd and the
# weight), RoPE (products, sums, negation, concatenation), casts and copies. A matmul ends the search.
_NORM_TO_ATTENTION = frozenset({"mul", "add", "neg", "cat", "clone", "expand", "_to_copy", "convert_element_type"})


def reaches_attention(base: Node, depth: int = 12) -> str | None:
    """'q', 'k' or 'v' where ``base`` reaches attention as that operand through element-wise products and sums (a
    norm, RoPE, a scaling), negation, concatenation, casts and copies, no matmul between (the input of Qwen3's,
    OLMo-2's and Gemma-3's q/k norms; a q/k/v projection's output); else None."""
    frontier, seen = [base], {base}
    for _ in range(depth):
        next_frontier = []
        for current in frontier:
            storage = storage_base(current)
            for user in users_through_views(current):
                operands = forward_attention_operands(user)
                for position, arg in enumerate(operands[:3]):
                    if isinstance(arg, Node) and storage_base(arg) is storage:
                        return "qkv"[position]
                operand = eager_attention_operand(user, storage)
                if operand is not None:
                    return operand
                if original_op(user) in _NORM_TO_ATTENTION and user not in seen:
                    seen.add(user)
                    next_frontier.append(user)
        frontier = next_frontier
    return None


def projected_into_attention(base: Node, loras: list[LoraLinear]) -> str | None:
    """'q', 'k' or 'v' where ``base`` is the input of a LoRA linear whose output reaches attention as that operand
    (``reaches_attention``): the q/k/v projections' input, whose LoRA A gradients read it; else None."""
    for lora in loras:
        if storage_base(lora.x) is base:
            operand = reaches_attention(lora.output)
            if operand is not None:
                return operand
    return None


def _lora_base_output(f: TensorFacts) -> Match | None:
    consumer = f.base.meta.get(LORA_REORDERED)
    if consumer is not None:
        return Role.LORA_BASE_OUTPUT, f"output rebuilt for {consumer}"
    return None


def _lora_intermediate(f: TensorFacts) -> Match | None:
    lora = f.lora_by_xa.get(f.base)
    if lora is not None:
        return Role.LORA_INTERMEDIATE, f"x@A, r={lora.rank}"
    return None


def _norm(f: TensorFacts) -> Match | None:
    # Fed into a norm, or used by a norm's backward; a norm's output read by a linear is not a norm role.
    norm_ops = (f.fw_ops() & NORMS) | (f.bw_ops() & NORM_BACKWARDS)
    if norm_ops:
        name = min(norm_ops).removeprefix("native_").removesuffix("_backward")
        if is_reduced_shape(f.val):
            return Role.SMALL, f"{name} statistics"
        if original_op(f.base) in NORMS:
            return Role.NORM_INPUT, f"normalized x̂ ({name})"
        return Role.NORM_INPUT, name
    if _is_rms_input(f.base):
        return Role.NORM_INPUT, "input (RMSNorm)"
    if f.base.target is aten.mul.Tensor and any(_is_rms_input(strip(a)) for a in tensor_args(f.base)):
        return Role.NORM_INPUT, "normalized x̂ (RMSNorm)"
    if is_reduced_shape(f.val) and _is_rms_stat(f.base):
        return Role.SMALL, "RMSNorm statistics"
    return None


def _activation(f: TensorFacts) -> Match | None:
    found = f.fw_ops() & ACTIVATIONS
    if found:
        return Role.ACT_INPUT, min(found)
    found = f.bw_ops() & ACTIVATION_BACKWARDS
    if found:
        name = min(found).removesuffix("_backward")
        derived = original_op(f.base) in ACTIVATION_BACKWARDS
        return Role.ACT_INPUT, f"{name} derivative" if derived else name
    for user in f.fw_users + [u for c in f.fw_users if c.target in DTYPE_CASTS for u in users_through_views(c)]:
        if original_op(user) in NONLINEAR_POINTWISE or _is_odd_power(user):
            return Role.ACT_INPUT, "hand-written pointwise"
    return None


def _loss_input(f: TensorFacts) -> Match | None:
    if is_reduced_shape(f.val):
        return None
    if _feeds(f.base, LOG_SOFTMAXES, depth=2):
        return Role.LOSS_INPUT, "logits"
    if _reaches_loss(f.base, f.saved_bases):
        return Role.LOSS_INPUT, "the loss's input follows from it"
    return None


def _reaches_loss(base: Node, saved_bases: frozenset[Node], depth: int = 16) -> bool:
    """Does a log-softmax's input, or the chunked loss's (passes/dynamo/chunk_loss.py), follow from ``base`` by ops
    that no other saved tensor cuts?

    Then the backward rebuilds the logits from ``base`` (recompute_logits makes that the case for the LM head),
    or rebuilds from it what the loss's gradient flows back through (the final norm), and its error reaches
    every gradient. A norm op that reads ``base`` does not cut, saved or not: its backward reads ``base`` (the
    final norm as one op, the chunked RMSNorm's).
    """
    frontier, seen = [base], {base}
    for _ in range(depth):
        next_frontier = []
        for node in frontier:
            for user in node.users:
                if original_op(user) in LOSS_OPS:
                    return True
                cut = user in saved_bases and not (node is base and original_op(user) in NORMS)
                if user not in seen and user.op == "call_function" and not cut:
                    seen.add(user)
                    next_frontier.append(user)
        frontier = next_frontier
    return False


def _rope_table(f: TensorFacts) -> Match | None:
    trig = rope_trig(f.base)
    return (Role.ROPE_TABLE, trig) if trig else None


def _row_scaled(f: TensorFacts) -> Match | None:
    """x in x * s where s has one value per row of x (broadcast along the last dimension) and is no parameter:
    backward reads x only for s's gradient."""
    if len(f.val.shape) < 2:
        return None
    for _, _, other_val in _mul_partners(f):
        if (other_val.is_floating_point() and other_val.dim() == f.val.dim() and other_val.shape[-1] == 1
                and 0 < numel_hint(other_val) < numel_hint(f.val)):
            return Role.ROW_SCALED, "x in x * s, one s per row"
    return None


def _mul_partners(f: TensorFacts) -> Iterator[tuple[Node, Node, torch.Tensor]]:
    """(mul, other operand, its value) for each two-tensor ``mul`` forward applies to the tensor by no parameter."""
    for user in f.fw_users:
        if user.target is not aten.mul.Tensor or len(operands := tensor_args(user)) != 2:
            continue
        other = operands[1] if storage_base(operands[0]) is f.base else operands[0]
        other_val = tensor_val(other)
        if other_val is not None and strip(other) not in f.params:
            yield user, other, other_val


def _product(f: TensorFacts) -> Match | None:
    for mul, other, other_val in _mul_partners(f):
        if (original_op(mul) == "mul" and numel_hint(other_val) == numel_hint(f.val)
                and rope_trig(storage_base(other)) is None):
            return Role.PRODUCT_INPUT, "x in x*y"
    return None




def reads_as_chunked_mlp_input(node: Node, base: Node) -> bool:
    return _reads_as_first_input(node, base, CHUNKED_MLP)


def chunked_rebuild_reader(base: Node) -> str | None:
    """The chunked op backward runs again from ``base`` (CHUNKED_MLP: its gate and up products; CHUNKED_NORM: the
    norm), where one reads it as its first input; else None."""
    return next((op for user in users_through_views(base) for op in (CHUNKED_MLP, CHUNKED_NORM)
                 if _reads_as_first_input(user, base, op)), None)


def _reads_as_first_input(node: Node, base: Node, op: str) -> bool:
    return schema_name(node.target) == op and isinstance(node.args[0], Node) and storage_base(node.args[0]) is base


def _linear_input(f: TensorFacts) -> Match | None:
    readers = []
    for user in f.fw_users:
        if reads_as_chunked_mlp_input(user, f.base):
            readers.append("chunked MLP: gate_proj, up_proj")
        elif _reads_as_first_input(user, f.base, CHUNKED_LINEARS):
            # the op carries its first linear's module
            others = len(user.args[1]) - 1
            readers.append(f"chunked LoRA linears: {_short_module(module_path(user))}"
                           + (f" and {others} more" if others else ""))
        elif schema_name(user.target) in GROUPED_MATMULS and storage_base(user.args[0]) is f.base:
            readers.append(_short_module(module_path(user)) or "experts")
        elif (user.target in MATMULS or user.target in BATCHED_MATMULS) and any(
                _from_parameters(o, f.params) for o in matmul_operands(user) if storage_base(o) is not f.base):
            readers.append(_short_module(module_path(user)))
    if readers:
        return Role.LINEAR_INPUT, ", ".join(dict.fromkeys(r for r in readers if r))
    return None


def _from_parameters(node: object, params: frozenset[Node], depth: int = 6) -> bool:
    """``node`` is a parameter, or computed from parameters alone (PEFT's merged router weight, W + B A)."""
    node = strip(node)
    if node in params:
        return True
    if depth == 0 or not isinstance(node, Node) or node.op != "call_function":
        return False
    operands = [a for a in node.args if isinstance(a, Node)]
    return bool(operands) and all(_from_parameters(a, params, depth - 1) for a in operands)


def _recomputed_roles(f: TensorFacts) -> Iterator[Match]:
    """The roles of the forward values backward recomputes from the saved tensor, nearest first: up to five
    recomputed steps on (gpt-oss's up projection in bf16: cast, clamp, clamp, cast and + 1 before the product)."""
    frontier, seen = list(f.bw_users), set()
    for _ in range(5):
        next_frontier = []
        for user in frontier:
            twin = f.fw_nodes.get(user.name)
            if user in seen or twin is None or twin.target != user.target or twin is f.base or tensor_val(
                    twin) is None:
                continue  # not a recomputation, or a multi-output op (its getitems are what gets classified)
            seen.add(user)
            twin_facts = TensorFacts(node=twin, base=storage_base(twin), fw_users=users_through_views(twin),
                                     bw_users=users_through_views(user), params=f.params, inputs=f.inputs,
                                     lora_by_xa=f.lora_by_xa, fw_nodes={},  # no fw_nodes: no recursion
                                     saved_bases=f.saved_bases)
            role, detail = classify(twin_facts)[0]
            if role is not Role.UNKNOWN:
                yield role, f"recomputes {twin.name}: {detail}" if detail else f"recomputes {twin.name}"
            next_frontier += users_through_views(user)
        frontier = next_frontier


def _recompute_source(f: TensorFacts) -> Match | None:
    """Saved only so that backward can recompute forward values: take the role of the nearest that has one."""
    return next(_recomputed_roles(f), None)


def _rebuilds_linear_input(f: TensorFacts) -> Match | None:
    """A norm's input from which backward rebuilds the norm's output, a linear's input: from it alone (and the row's
    statistic), so its error is that input's. (A product's operands, SwiGLU's gate and up, share theirs.)"""
    norm = _norm(f)
    if norm is None or norm[0] is not Role.NORM_INPUT:
        return None
    return next((m for m in _recomputed_roles(f) if m[0] is Role.LINEAR_INPUT), None)


def _small_or_index(f: TensorFacts) -> Match | None:
    if not is_floating(f.val):
        return Role.INDEX, original_op(f.base)
    if is_reduced_shape(f.val):
        return Role.SMALL, original_op(f.base)
    return None


RULES: tuple[Callable[[TensorFacts], Match | None], ...] = (
    _parameter, _loss_gradient, _lora_base_output, _dropout_mask, _fused_attention, _lora_intermediate, _router,
    _eager_attention, _norm,
    _activation, _loss_input, _rope_table, _row_scaled, _product, _linear_input, _small_or_index, _recompute_source,
    _rebuilds_linear_input,
)


def classify(facts: TensorFacts) -> list[Match]:
    """Every role the tensor matches, most specific first; [(UNKNOWN, producer)] if none."""
    matches = [m for m in (rule(facts) for rule in RULES) if m is not None]
    if not matches:
        return [(Role.UNKNOWN, original_op(facts.base))]
    if matches[0][0] in FREES_NOTHING:
        return matches[:1]
    return matches


# What lies between attention's scores and its softmax: scale, mask, soft-capping, a sink's column joined (gpt-oss).
_SCORE_PASSTHROUGH = frozenset({"add", "sub", "mul", "div", "where", "masked_fill", "tanh", "cat"})


def _feeds(node: Node, ops: frozenset[str], depth: int = 8, through: frozenset[str] = _SCORE_PASSTHROUGH) -> bool:
    """Does ``node``'s value reach an op in ``ops`` through views, casts and the pointwise ops ``through`` (scale and
    mask by default)?"""
    frontier, seen = [node], {node}
    for _ in range(depth):
        next_frontier = []
        for current in frontier:
            for user in users_through_views(current):
                name = original_op(user)
                if name in ops:
                    return True
                if (user.target in DTYPE_CASTS or name in through) and user not in seen:
                    seen.add(user)
                    next_frontier.append(user)
        frontier = next_frontier
    return False


def from_softmax(node: object) -> bool:
    """A softmax's output, maybe through dropout or a clone: attention's probabilities, not its scores."""
    if not isinstance(node, Node):
        return False
    return any(original_op(p) in SOFTMAXES for p in walk_back(node, through=("native_dropout", "clone"), depth=6))


def _is_rms_input(node: object) -> bool:
    """x in x * rsqrt(mean(x**2, -1) + eps), possibly through a view (a norm over each head: Qwen3's and Gemma-3's
    q/k norms) and a dtype cast."""
    if not isinstance(node, Node):
        return False
    forms, stack = [node], [node]
    while stack:
        views = [u for u in stack.pop().users if is_view(u)]
        forms += views
        stack += views
    candidates = forms + [u for x in forms for u in x.users if u.target in DTYPE_CASTS]
    for x in candidates:
        for square in x.users:
            is_square = (square.target is aten.pow.Tensor_Scalar and square.args[1] == 2) or \
                        (square.target is aten.mul.Tensor and square.args[0] is x and square.args[1] is x)
            if is_square and any(u.target in (aten.mean.dim, aten.sum.dim_IntList) for u in square.users):
                return True
    return False


def _is_rms_stat(node: Node) -> bool:
    """rsqrt(mean(x**2, -1) + eps) of an RMSNorm input x."""
    for producer in walk_back(node, through=("add", "rsqrt", "sqrt", "reciprocal"), depth=4):
        if producer.target in (aten.mean.dim, aten.sum.dim_IntList):
            square = producer.args[0]
            if isinstance(square, Node) and square.args and _is_rms_input(strip(square.args[0])):
                return True
    return False


def rope_trig(node: Node) -> str | None:
    """'cos' or 'sin' if ``node`` is a rotary table: cos/sin of positions, maybe scaled, cast, expanded."""
    for producer in walk_back(node, through=("mul", "cat", "clone", "expand", "unsqueeze"), depth=6):
        if original_op(producer) in ("cos", "sin"):
            return original_op(producer)
    return None


def _is_odd_power(node: Node) -> bool:
    return node.target is aten.pow.Tensor_Scalar and node.args[1] not in (1, 2)


_PEFT_WRAPPERS = frozenset({"base_layer", "lora_A", "lora_B", "default"})


def _short_module(path: str) -> str:
    """The linear's own name ('q_proj' for '...self_attn.q_proj.base_layer'), for a readable detail."""
    parts = [p for p in path.split(".") if p not in _PEFT_WRAPPERS]
    return parts[-1] if parts else ""
