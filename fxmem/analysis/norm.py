"""RMSNorm units in a forward graph: input x, per-row rstd, weight gamma and output gamma * x * rstd.

LoRAct's pre-norm sharing (section 3.3) saves only the output, which the
following linears save anyway, and rebuilds the input in backward as
output / gamma / rstd. This module finds the pieces; the policy decides and
``passes/lowrank.py`` rewrites.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Node

from fxmem.analysis.graph import DTYPE_CASTS, aten, tensor_args, tensor_val, walk_back


@dataclass(frozen=True)
class RmsNormUnit:
    x: Node  # the norm's input, as saved (before any cast to the compute dtype)
    normalized: Node  # x * rstd, in the compute dtype
    rstd: Node  # 1 / sqrt(mean(x**2, -1) + eps), one value per row
    gamma: Node  # the weight, a graph input of shape (hidden,)
    output: Node  # gamma * x * rstd: what the following linears read


def _casts_of(node: Node) -> list[Node]:
    return [node] + [u for u in node.users if u.target in DTYPE_CASTS]


def _is_rstd_of(stat: Node, x_forms: list[Node]) -> bool:
    """``stat`` is rsqrt(mean(x**2, -1) + eps) for x one of ``x_forms`` (x and its casts)."""
    if stat.target is not aten.rsqrt.default:
        return False
    for producer in walk_back(stat, through=("add", "rsqrt"), depth=4):
        if producer.target is aten.mean.dim and producer.args[1] in ([-1], (-1,), [len(tensor_val(stat).shape) - 1]):
            square = producer.args[0]
            return (isinstance(square, Node) and square.target is aten.pow.Tensor_Scalar and square.args[1] == 2
                    and square.args[0] in x_forms)
    return False


def rms_norm_unit(x: Node) -> RmsNormUnit | None:
    """The RMSNorm whose input is ``x`` (a storage base), written as HF's Llama/Mistral/Qwen write it; None if
    ``x`` feeds no such norm. Fused ``rms_norm`` ops and LayerNorm are not matched."""
    x_val = tensor_val(x)
    if x_val is None or x_val.dim() < 2:
        return None
    x_forms = _casts_of(x)
    for form in x_forms:
        for normalized in form.users:
            operands = tensor_args(normalized)
            if normalized.target is not aten.mul.Tensor or len(operands) != 2 or form not in operands:
                continue
            rstd = operands[1] if operands[0] is form else operands[0]
            if not _is_rstd_of(rstd, x_forms):
                continue
            for cast in _casts_of(normalized):
                for output in cast.users:
                    scaled = tensor_args(output)
                    if output.target is not aten.mul.Tensor or len(scaled) != 2 or cast not in scaled:
                        continue
                    gamma = scaled[1] if scaled[0] is cast else scaled[0]
                    gamma_val = tensor_val(gamma)
                    if (gamma.op == "placeholder" and gamma_val.dim() == 1
                            and gamma_val.shape[0] == x_val.shape[-1]
                            and tuple(tensor_val(output).shape) == tuple(x_val.shape)):
                        return RmsNormUnit(x=x, normalized=normalized, rstd=rstd, gamma=gamma, output=output)
    return None
