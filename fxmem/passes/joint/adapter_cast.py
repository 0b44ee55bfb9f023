"""Save x, not its copy in the adapters' dtype: the cast feeding a LoRA branch is recomputed in backward.

PEFT keeps the adapters in fp32 on a bf16 or fp16 model and casts x to fp32 before ``lora_A``. Autograd then
saves that fp32 copy for A's gradient: twice x's bytes, and a different node from the x the frozen matmul reads,
so nothing the planner does for x reaches it. The copy of o_proj's input was quantized at 4 bits where, without
the cast, x is recomputed with attention; X W was stored where it is replayed from x; the norm input was stored
where it is rebuilt from x's codes.

The widening cast to the adapters' dtype (and the views around it) is tagged must-recompute; the cast is exact, so
gradients are unchanged. Where a lossy plan follows (``Config.compresses``), x is also tagged must-save: min-cut
never recomputes a tensor that a backward matmul reads, but through the cast it no longer sees that matmul, and
it recomputed x from the norm's input, which the plan then stored at 4 bits. The region is then partitioned as if
the adapters had x's dtype: on a bf16 Llama with fp32 adapters the gradients are then those of the same model with
bf16 adapters, where recomputing the cast alone barely moved them (measured: docs/quantization.md). Under
exact plans min-cut's choice stands: recomputing x from what it saves anyway costs no bytes, where x must-save
would add them.

A narrowing cast (autocast running an fp32 model's LoRA in bf16) is left alone: there the copy is the smaller.
"""

from __future__ import annotations

import operator

from torch.fx import Node
from torch.utils.checkpoint import CheckpointPolicy

from fxmem.analysis.graph import DTYPE_CASTS, is_view, storage_base, storage_bytes, tensor_val
from fxmem.analysis.lora import find_lora_linears, matmul_operands
from fxmem.analysis.meta import RECOMPUTE
from fxmem.config import Config
from fxmem.passes.manager import UNCHANGED, GraphPass, PassResult, PipelineState, joint_primals, tag_must_recompute


def keep_x_saved(x: Node, config: Config) -> None:
    """Where a lossy plan follows, tag x must-save: a LoRA branch's input recomputed from x hides from min-cut the
    backward matmul that reads it, and min-cut would recompute x from a norm's input the plan then compresses."""
    x = storage_base(x)  # must-save has no effect on a view
    # A getitem of a multi-output op (fused attention's output) is not min-cut's to save or recompute: its op is; a
    # later pass may still tag x must-recompute (attention recomputed in backward).
    if config.compresses and x.op == "call_function" and x.target is not operator.getitem \
            and RECOMPUTE not in x.meta:
        x.meta[RECOMPUTE] = CheckpointPolicy.MUST_SAVE


class RecomputeAdapterCast(GraphPass):
    name = "recompute_adapter_cast"
    stage = "joint"

    def run(self, state: PipelineState) -> PassResult:
        graph = state.joint.graph
        casts: dict[Node, list[Node]] = {}  # the cast -> its chain, once for LoRA linears reading one cast
        for lora in find_lora_linears(graph, joint_primals(graph)):
            x_lora, lora_a_t = matmul_operands(lora.xa)
            chain = widening_cast(x_lora)
            if chain and tensor_val(chain[-1]).dtype == tensor_val(lora_a_t).dtype:
                casts.setdefault(chain[-1], chain)
        for cast, chain in casts.items():
            tag_must_recompute(chain)
            keep_x_saved(cast.args[0], state.config)
        if not casts:
            return UNCHANGED
        copies = sum(storage_bytes(tensor_val(cast)) for cast in casts)
        saved = "x saved" if state.config.compresses else "x saved or recomputed as min-cut chooses"
        note = (f"{len(casts)} cast(s) of x to the adapters' dtype ({copies / 2**20:.1f} MiB of copies) recomputed "
                f"in backward; {saved}")
        return PassResult(True, note)


def widening_cast(x_lora: Node) -> list[Node]:
    """The views from ``x_lora`` back to the one cast that made it from x, that cast last, where the cast widens
    (bf16 x to fp32 adapters); else []. Stops at that cast: x is its input, whatever made it (a norm ending in a cast
    of its own, as Gemma's does, is x's producer, not part of the chain)."""
    chain, current = [], x_lora
    while isinstance(current, Node) and is_view(current):
        chain.append(current)
        current = current.args[0]
    if not (isinstance(current, Node) and current.target in DTYPE_CASTS and isinstance(current.args[0], Node)):
        return []
    wide, narrow = tensor_val(current), tensor_val(current.args[0])
    if wide is None or narrow is None or wide.dtype.itemsize <= narrow.dtype.itemsize:
        return []
    return [*chain, current]
