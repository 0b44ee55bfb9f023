"""The record of one compiled region: what fxmem found, planned and did there.

A record holds names and figures, no graph: the graphs (and the fake tensors in their nodes) are freed once inductor
has compiled them, however long the report is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fxmem.analysis import SavedRecord
from fxmem.analysis.liveness import Liveness
from fxmem.config import Config
from fxmem.cost_model.plan import Plan
from fxmem.fallback import fall_back
from fxmem.kernels.calibration import QuantSlot
from fxmem.passes import PassRecord


@dataclass
class Region:
    """One graph dynamo handed to the backend, and everything fxmem decided for it."""

    index: int
    config: Config
    kind: Literal["compiling", "training", "inference"] = "compiling"
    saved: list[SavedRecord] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)  # as the passes applied them (Plan.record: no graph references)
    # as the planner made them: where a pass left one undone (a rollback, a tensor backward could not rebuild, an
    # offload it could not move), ``plans`` holds what was applied instead and says why
    planned: list[Plan] = field(default_factory=list)
    passes: list[PassRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    slots: list[QuantSlot] = field(default_factory=list)  # quantization state of the saved tensors
    probes: list[tuple[int, str]] = field(default_factory=list)  # fidelity probes: (id, saved tensor name)
    demoted: dict[str, int] = field(default_factory=dict)  # the guard's demotions its plans applied: key -> steps
    compile_seconds: float = 0.0
    budget_bytes: float | None = None  # memory_budget's target in bytes, where one is set
    # what the final forward and backward graphs hold at once beside their inputs (analysis/liveness.py), one pair
    # per partition (inductor may partition nested subgraphs of the region through the same hook)
    liveness: list[tuple[Liveness, Liveness]] = field(default_factory=list)
    compiled_liveness: list[tuple[Liveness, Liveness]] = field(default_factory=list)  # the same as inductor runs them

    def undone(self) -> list[tuple[SavedRecord, Plan, Plan]]:
        """Each saved tensor whose plan the passes did not apply as planned: (tensor, planned, applied)."""
        return [(saved, planned, applied) for saved, planned, applied in zip(self.saved, self.planned, self.plans,
                                                                              strict=True) if planned != applied]

    def add_passes(self, records: list[PassRecord]) -> None:
        """Record passes; each one that failed (its stage rolled back) warns, once per region and pass."""
        warned = {r.name for r in self.passes if r.error is not None}
        for record in records:
            if record.error is not None and record.name not in warned:
                warned.add(record.name)
                fall_back(f"fxmem region {self.index}: pass {record.name} failed and its {record.stage} stage was "
                          f"rolled back, so none of that stage's rewrites apply here ({record.error})", self.config,
                          stacklevel=3)
        self.passes += records

    @property
    def transient_bytes(self) -> int:
        """The most the region's graphs hold beyond their inputs and what forward returns: the forward's
        transients, or everything backward allocates (its gradients included) at its peak, run as aten ops in order
        with the saved tensors held to the end (the eager lowering)."""
        return max((max(fw.transient_bytes, bw.peak_bytes) for fw, bw in self.liveness), default=0)

    @property
    def compiled_transient_bytes(self) -> int:
        """``transient_bytes`` as inductor runs the graphs (analysis.liveness.compiled_liveness): element-wise ops
        computed inside their readers' kernels, and backward freeing each saved activation after its last reader, so
        that what it adds at its peak is net of what it freed by then."""
        return max((max(fw.transient_bytes, bw.peak_bytes) for fw, bw in self.compiled_liveness), default=0)
