"""What fxmem found and decided, per saved tensor, role, layer and region: tables and JSON."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console, Group, RenderableType
from rich.table import Table

from fxmem.version import __version__
from fxmem.analysis import ROLE_DESCRIPTIONS, Role, SavedRecord
from fxmem.cost_model import host_bytes, planned_bytes
from fxmem.cost_model.plan import Action, Plan
from fxmem.measure import format_bytes
from fxmem.region import Region

if TYPE_CHECKING:
    from fxmem.guard import GuardCheck

# A reason's figures for one tensor, e.g. "(4 x 64)" or "(512 >= 384 bytes)": dropped to group tensors by rule.
_FIGURES = re.compile(r" ?\([^()]*\d[^()]*\)")


class Report:
    """The saved tensors of every compiled region, with their plans and byte counts."""

    def __init__(self, regions: Sequence[Region], guard_checks: Sequence[GuardCheck] = ()) -> None:
        self.regions = list(regions)
        self.guard_checks = list(guard_checks)

    def guard_notes(self) -> list[str]:
        """Each of the guard's checks (fxmem/guard.py), and the demotions no compiled region applied: a tensor the
        guard demoted on its slice that the training graph does not have under that key."""
        notes = [check.summary() for check in self.guard_checks]
        if not self.guard_checks and any(r.kind == "training" and r.config.guard and r.config.compresses
                                         for r in self.regions):
            notes.append("guard: no check of this plan ran (the guard checks training batches through fxmem.compile_ "
                         "and fxmem.inspect; torch.compile(model, backend=...) hands fxmem graphs, not batches)")
        applied = {key for region in self.regions for key in region.demoted}
        missing = sorted({d.tensor for check in self.guard_checks for d in check.demotions} - applied)
        if missing and any(r.kind == "training" for r in self.regions):
            notes.append(f"guard: {len(missing)} demoted tensor(s) not found in the compiled training graphs, left as "
                         f"planned: {', '.join(missing)}")
        return notes

    def rows(self) -> list[tuple[Region, SavedRecord, Plan]]:
        return [(r, s, p) for r in self.regions for s, p in zip(r.saved, r.plans, strict=True)]

    @property
    def activation_bytes(self) -> int:
        """Saved-activation bytes before fxmem's rewrites (parameters and inputs excluded)."""
        return sum(s.nbytes for _, s, _ in self.rows())

    @property
    def planned_bytes(self) -> int:
        """Saved-activation bytes after the planned rewrites."""
        return sum(planned_bytes(s, p) for _, s, p in self.rows())

    @property
    def host_bytes(self) -> int:
        """Saved-activation bytes the plans keep in host memory instead (block_offload)."""
        return sum(host_bytes(s, p) for _, s, p in self.rows())

    def _totals(self, key, activations_only: bool = False) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for _, saved, plan in self.rows():
            if activations_only and not saved.frees_memory:
                continue
            entry = totals.setdefault(key(saved), {"count": 0, "bytes": 0, "planned_bytes": 0})
            entry["count"] += 1
            entry["bytes"] += saved.nbytes
            entry["planned_bytes"] += planned_bytes(saved, plan)
        return totals

    def by_role(self) -> dict[str, dict[str, int]]:
        return self._totals(lambda s: s.role.value)

    def by_layer(self) -> dict[str, dict[str, int]]:
        """Activation bytes per repeated block (parameters and inputs left out)."""
        return self._totals(lambda s: s.layer or "(outside blocks)", activations_only=True)

    def kept_by_reason(self) -> dict[str, dict[str, int]]:
        """Activation bytes the plan keeps exact, by the rule that kept them: the plan's reason without the
        tensor's own figures, so that one rule is one row."""
        totals: dict[str, dict[str, int]] = {}
        for _, saved, plan in self.rows():
            if plan.action is not Action.KEEP or not saved.frees_memory or saved.shares_storage_with:
                continue
            entry = totals.setdefault(_FIGURES.sub("", plan.reason), {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += planned_bytes(saved, plan)  # on the device: none for what waits in host memory
        return dict(sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "fxmem_version": __version__,
            "torch_version": torch.__version__,
            "activation_bytes": self.activation_bytes,
            "planned_bytes": self.planned_bytes,
            "host_bytes": self.host_bytes,
            "by_role": self.by_role(),
            "by_layer": self.by_layer(),
            "kept_by_reason": self.kept_by_reason(),
            "guard": [check.to_dict() for check in self.guard_checks],
            "regions": [{
                "index": r.index,
                "kind": r.kind,
                "config": r.config.to_dict(),
                "compile_seconds": round(r.compile_seconds, 3),
                "budget_bytes": r.budget_bytes,
                "notes": r.notes,
                "demoted": r.demoted,
                "quantization": [slot.to_dict() for slot in r.slots],
                "passes": [p.to_dict() for p in r.passes],
                "saved": [dict(s.to_dict(), plan=p.to_dict(), planned_bytes=planned_bytes(s, p),
                               **({"planned": q.to_dict()} if q != p else {}))
                          for s, p, q in zip(r.saved, r.plans, r.planned, strict=True)],
            } for r in self.regions],
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def renderables(self, include_all: bool = False) -> list[RenderableType]:
        """Rich tables; parameters and inputs (they free nothing) are listed only with ``include_all``."""
        prefix = _common_prefix([s.module for _, s, _ in self.rows()])
        tensors = Table(title="Tensors saved for backward", title_justify="left")
        for column in ("region", "#", "tensor", "role", "detail", "module", "shape", "dtype"):
            tensors.add_column(column)
        for column in ("bytes", "plan", "bits", "outliers", "rank", "after", "price"):
            tensors.add_column(column, justify="right" if column != "plan" else "left")
        hidden = 0
        for region, saved, plan in self.rows():
            if not (saved.frees_memory or include_all):
                hidden += 1
                continue
            shown = "—" if not saved.frees_memory else (
                f"(= {saved.shares_storage_with})" if saved.shares_storage_with else format_bytes(saved.nbytes))
            tensors.add_row(str(region.index), str(saved.index), saved.name, saved.role.value, saved.detail,
                            saved.module.removeprefix(prefix).lstrip(".") or "(top)", saved.shape_text,
                            saved.dtype, shown, plan.action.value, *(str(getattr(plan, f, 0) or "") for f in _COLUMNS),
                            format_bytes(planned_bytes(saved, plan)),
                            f"{plan.seconds * 1e3:.2f} ms" if plan.seconds else "")
        parts: list[RenderableType] = [tensors,
                                       _totals_table("By role", "role", self.by_role(), describe_roles=True),
                                       _totals_table("By layer", "layer", self.by_layer())]
        kept = self.kept_by_reason()
        if kept:
            parts.append(_kept_table(kept, self.planned_bytes))
        if hidden:
            parts.append(f"{hidden} saved parameters/inputs free nothing and are not listed (include_all / --all)")
        kinds = [r.kind for r in self.regions]
        before, after = self.activation_bytes, self.planned_bytes
        ratio = f" ({before / after:.2f}x smaller)" if after and after != before else ""
        parts.append(f"regions: {len(kinds)} ({kinds.count('training')} training, {kinds.count('inference')} "
                     f"inference); saved activations: {format_bytes(before)} as partitioned (after any joint-pass "
                     f"recomputation), {format_bytes(after)} after the plan{ratio}"
                     + (f", and {format_bytes(self.host_bytes)} in host memory" if self.host_bytes else ""))
        parts += self.guard_notes()
        for region in self.regions:
            parts += [f"region {region.index}: {note}" for note in region.notes]
            if region.slots and region.config.calibration == "static":
                calibrated = sum(slot.calibrated for slot in region.slots)
                parts.append(f"region {region.index}: {len(region.slots)} quantized storages, {calibrated} with "
                             f"frozen scales (static, {region.config.calibration_steps} calibration steps)")
            else:
                quantized = sum(p.action is Action.QUANTIZE and p.nbytes is not None for p in region.plans)
                if quantized:
                    parts.append(f"region {region.index}: {quantized} quantized storages, scales from every batch "
                                 "(dynamic)")
            parts += [f"region {region.index}: pass {p.name} ({p.stage}): {p.error or p.note or 'no change'}"
                      for p in region.passes]
        return parts

    def table(self, width: int = 160, include_all: bool = False) -> str:
        """The report as plain text."""
        console = Console(file=io.StringIO(), width=width, color_system=None)
        console.print(Group(*self.renderables(include_all)))
        return console.file.getvalue()


# The plan fields the table shows, on the plans that have them (Quantize's bits and outliers, LowRank's rank)
_COLUMNS = ("bits", "outliers", "rank")


def _totals_table(title: str, key_name: str, totals: dict[str, dict[str, int]],
                  describe_roles: bool = False) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column(key_name)
    for column in ("tensors", "bytes", "after"):
        table.add_column(column, justify="right")
    if describe_roles:
        table.add_column("what it is")
    for key, entry in sorted(totals.items(), key=lambda kv: -kv[1]["bytes"]):
        row = [key, str(entry["count"]), format_bytes(entry["bytes"]), format_bytes(entry["planned_bytes"])]
        if describe_roles:
            row.append(ROLE_DESCRIPTIONS[Role(key)])
        table.add_row(*row)
    return table


def _kept_table(kept: dict[str, dict[str, int]], planned: int) -> Table:
    table = Table(title="Kept exact, by reason", title_justify="left")
    table.add_column("reason")
    for column in ("tensors", "bytes", "of saved after the plan"):
        table.add_column(column, justify="right")
    for reason, entry in kept.items():
        table.add_row(reason, str(entry["count"]), format_bytes(entry["bytes"]),
                      f"{entry['bytes'] / planned:.0%}" if planned else "")
    return table


def _common_prefix(paths: list[str]) -> str:
    split = [p.split(".") for p in paths if p]
    if len(split) < 2:
        return ""
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
