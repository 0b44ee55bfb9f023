"""The one error scale every option is weighed on (cost_model/solve.py compares it first, under a preset's ceilings
and under memory_budget alike): exact, then quantization down BUDGET_STAGES, the least sensitive tensors first, then
what no bit width bounds."""

from __future__ import annotations

from fxmem.analysis import Role, SavedTensor
from fxmem.cost_model.plan import LowRank, Plan, Quantize, RebuildNormInput, Sparsify

# Quantization's (bits, sensitivity) classes, in the order memory_budget takes them until the region fits.
# Sensitivity 0 is activation and product inputs and X W; 1 norm inputs; 2 linear inputs; 3 attention's q, k, v.
# The least sensitive go first, and q, k, v drop below 8 bits last, after everything else is at 2
# (docs/quantization.md measures why: the softmax amplifies their error; a linear input's error reaches its LoRA A's
# gradient whole, and at 2 bits it was worse than a norm input's).
BUDGET_STAGES = ((8, 0), (8, 1), (8, 2), (8, 3), (4, 0), (4, 1), (4, 2), (2, 0), (2, 1), (2, 2), (4, 3), (2, 3))

EXACT_ERROR = 0  # kept, recomputed, replayed, or with its checkpointed block from exact sources
ONE_BIT_ERROR = len(BUDGET_STAGES) + 1  # 1-bit codes, which only a preset asks for
# Low-rank factors and sparsified rows: a rank keeps a subspace and a sparsified row drops probability mass, neither
# bounded by a range as codes are; a storage is factored under memory_budget only once its codes reached their floor.
UNBOUNDED_ERROR = len(BUDGET_STAGES) + 2


def sensitivity(owner: SavedTensor) -> int:
    """How far a storage's error reaches the gradient (BUDGET_STAGES' second number)."""
    if (owner.feeds_attention or owner.reaches_attention) is not None:
        return 3
    if Role.LINEAR_INPUT in (owner.role, *owner.also):
        return 2
    return 1 if owner.role is Role.NORM_INPUT else 0


def error_class(owner: SavedTensor, plan: Plan) -> int:
    """``plan``'s class on the one error scale. A norm input rebuilt from its output's codes carries their rounding:
    it is classed as codes of that width for the input's own sensitivity."""
    if isinstance(plan, (LowRank, Sparsify)) or (isinstance(plan, RebuildNormInput) and plan.bits is None):
        return UNBOUNDED_ERROR
    if isinstance(plan, (Quantize, RebuildNormInput)):
        stage = (plan.bits, sensitivity(owner))
        return 1 + BUDGET_STAGES.index(stage) if stage in BUDGET_STAGES else ONE_BIT_ERROR
    return EXACT_ERROR
