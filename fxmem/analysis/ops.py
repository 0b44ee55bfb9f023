"""The aten ops the analysis reads by name: activations, norms, softmaxes, losses, batched and grouped matmuls, fused
attention, and fxmem's own chunked ops; and the arguments an op is called with."""

from __future__ import annotations

from torch.fx import Node

from fxmem.analysis.graph import aten, original_op

ACTIVATIONS = frozenset({
    "silu", "gelu", "relu", "tanh", "sigmoid", "elu", "leaky_relu", "softplus", "mish", "hardswish",
    "hardsigmoid", "hardtanh", "celu", "selu", "glu", "relu6", "threshold", "log_sigmoid_forward", "prelu",
    "_prelu_kernel",
})
ACTIVATION_BACKWARDS = frozenset({f"{a}_backward" for a in ACTIVATIONS} | {"log_sigmoid_backward"})
NORMS = frozenset({
    "native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm", "batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_fused_rms_norm", "rms_norm",
    "chunked_rms_norm",  # fxmem's (kernels/chunked_rms_norm.py)
})
NORM_BACKWARDS = frozenset({
    "native_layer_norm_backward", "native_group_norm_backward", "native_batch_norm_backward",
    "_fused_rms_norm_backward", "chunked_rms_norm_backward",
})
SOFTMAXES = frozenset({"_softmax", "softmax", "_safe_softmax"})
LOG_SOFTMAXES = frozenset({"_log_softmax", "log_softmax"})
LOSS_OPS = LOG_SOFTMAXES | {"linear_cross_entropy"}  # the chunked loss: fxmem.kernels.linear_cross_entropy
# Pointwise ops that make a hand-written activation (GPT-2's tanh GELU, x * sigmoid(x)).
NONLINEAR_POINTWISE = frozenset({"tanh", "exp", "sigmoid", "erf", "log1p", "expm1", "sin", "cos"})
BATCHED_MATMULS = frozenset({aten.bmm.default, aten.baddbmm.default})
# Matmuls of rows sorted by expert with stacked expert weights (torch's, transformers' fallback, fxmem's LoRA on
# experts: fxmem/kernels/grouped_lora.py): their first input is the experts' input
GROUPED_LORA = "fxmem::grouped_lora"
GROUPED_MATMULS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback", GROUPED_LORA})


def op_argument(node: Node, name: str, default: object = None) -> object:
    """The argument ``name`` of an aten op's call, by its schema (positional or keyword); ``default`` where the op
    has no such argument or the call leaves it out."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if name not in names:
        return default
    index = names.index(name)
    return node.args[index] if index < len(node.args) else node.kwargs.get(name, default)


def dropout_probability(node: Node) -> float:
    """The ``dropout_p`` an op is called with (fused attention's), 0.0 for an op without one; 1.0 when symbolic."""
    value = op_argument(node, "dropout_p", 0.0)
    return float(value) if isinstance(value, (int, float)) else 1.0


def is_fused_attention(node: Node) -> bool:
    name = original_op(node)
    return node.op == "call_function" and "backward" not in name and (
        "scaled_dot_product" in name or name in ("_flash_attention_forward", "_efficient_attention_forward"))


# fxmem's chunked MLP (kernels/chunked_mlp.py): its first input feeds the gate and up projections, which backward
# replays from it
CHUNKED_MLP = "fxmem::chunked_swiglu_mlp"
# fxmem's chunked LoRA linears (kernels/chunked_lora_linear.py): their first input feeds each linear
CHUNKED_LINEARS = "fxmem::chunked_lora_linears"
# fxmem's chunked RMSNorm (kernels/chunked_rms_norm.py), recomputed in backward from its first input
# (passes/dynamo/chunk_norm.py)
CHUNKED_NORM = "fxmem::chunked_rms_norm"
