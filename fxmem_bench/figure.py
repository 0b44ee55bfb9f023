"""The README's figure: step peak against step time of every method of a compare table, one panel per workload.

Both axes are ratios to torch.compile's on the same workload (a CPU's seconds say nothing of a GPU's; the ratios
are what the tables claim). fxmem's point carries its worst gradient cosine and its preset's published bound.

The PNG carries a digest of the figures it plots (a PNG text chunk), so that `fxmem bench report --check` can tell
whether it is stale without drawing it again: matplotlib's pixels differ between versions, the figures do not.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from fxmem_bench.compare import MethodResult

DIGEST_KEY = "fxmem-figure-data"
DRAWING = 1  # raise when draw() changes how the figure looks: the digest then finds the PNG stale
REFERENCE_METHOD = "compile"  # both axes are ratios to this method's


@dataclass(frozen=True)
class Point:
    label: str
    peak: float  # step peak over the reference method's
    time: float  # median per-round step time over the reference method's
    time_low: float  # the rounds' range
    time_high: float
    is_fxmem: bool


@dataclass(frozen=True)
class Panel:
    workload: str
    title: str  # fxmem's preset and gradient fidelity
    points: tuple[Point, ...]


def panel(workload: str, preset: str, results: Sequence[MethodResult], label: str) -> Panel | None:
    """The workload's methods as ratios to torch.compile's; None where torch.compile or fxmem did not run."""
    from fxmem.timing import round_ratio

    reference = next((r for r in results if r.method == REFERENCE_METHOD), None)
    ours = next((r for r in results if r.method == "fxmem"), None)
    if reference is None or ours is None:
        return None
    points = []
    for r in results:
        ratio = round_ratio(r.step_samples, reference.step_samples)
        points.append(Point(label(r), round(r.peak_bytes / reference.peak_bytes, 3), round(ratio.median, 3),
                            round(ratio.low, 3), round(ratio.high, 3), r is ours))
    fidelity = (f"worst grad cos {ours.fidelity.min_cosine:.4f} over {ours.fidelity.compared} gradients"
                if ours.fidelity else "")
    bound = f" (bound {ours.fidelity_bound:g})" if ours.fidelity_bound is not None else ""
    return Panel(workload, f"{workload}: fxmem {preset}, {fidelity}{bound}", tuple(points))


def digest(panels: Sequence[Panel]) -> str:
    """What the figure plots and how it is drawn, hashed: the same figures give the same digest on any
    matplotlib."""
    drawn = {"drawing": DRAWING, "panels": [asdict(p) for p in panels]}
    return hashlib.sha256(json.dumps(drawn, sort_keys=True).encode()).hexdigest()


def draw(panels: Sequence[Panel], path: pathlib.Path) -> None:
    """The panels side by side, written as a PNG at ``path`` with their digest."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False)
    for axis, p in zip(axes[0], panels, strict=True):
        for point, offset in zip(p.points, _label_offsets(p.points), strict=True):
            color = "tab:red" if point.is_fxmem else "tab:blue"
            axis.errorbar(point.time, point.peak, xerr=[[point.time - point.time_low], [point.time_high - point.time]],
                          fmt="*" if point.is_fxmem else "o", color=color, markersize=13 if point.is_fxmem else 6,
                          capsize=2, linewidth=0.8)
            axis.annotate(point.label, (point.time, point.peak), textcoords="offset points", xytext=offset,
                          horizontalalignment="left" if offset[0] > 0 else "right",
                          fontsize=8, color=color, fontweight="bold" if point.is_fxmem else "normal")
        axis.axhline(1.0, color="grey", linewidth=0.5)
        axis.axvline(1.0, color="grey", linewidth=0.5)
        axis.set_ylim(bottom=0)
        axis.set_title(p.title, fontsize=9)
        axis.set_xlabel("step time / torch.compile's (median of interleaved rounds, bars: their range)", fontsize=8)
        axis.set_ylabel("step peak / torch.compile's", fontsize=8)
        axis.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110, metadata={DIGEST_KEY: digest(panels), "Software": None})
    plt.close(figure)


# a label's size as a share of the axes (8-point text on axes about 360 x 300 points)
_CHAR_WIDTH, _LABEL_HEIGHT = 5.5 / 360, 11 / 300
# where a label may go, in points from its point: right above, right below, left above, left below
_PLACES = ((5, 4), (5, -12), (-5, 4), (-5, -12))


def _label_offsets(points: Sequence[Point]) -> list[tuple[int, int]]:
    """Each label's offset from its point: the first place where its box overlaps no label placed before."""
    x_span = (max(p.time for p in points) - min(p.time for p in points)) * 1.15 or 1.0
    y_span = max(p.peak for p in points) * 1.05 or 1.0
    boxes: list[tuple[float, float, float, float]] = []
    offsets = []
    for point in points:
        width, height = len(point.label) * _CHAR_WIDTH * x_span, _LABEL_HEIGHT * y_span
        for dx, dy in _PLACES:
            left = point.time + (dx / 360 * x_span if dx > 0 else dx / 360 * x_span - width)
            bottom = point.peak + dy / 300 * y_span
            box = (left, bottom, left + width, bottom + height)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in boxes):
                break
        boxes.append(box)
        offsets.append((dx, dy))
    return offsets


def recorded_digest(path: pathlib.Path) -> str | None:
    """The digest a PNG written by ``draw`` carries; None for a missing file or one without it."""
    if not path.exists():
        return None
    data = path.read_bytes()
    offset = 8  # the PNG signature
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset:offset + 8])
        body = data[offset + 8:offset + 8 + length]
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            if key.decode("latin-1") == DIGEST_KEY:
                return value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            if key.decode("latin-1") == DIGEST_KEY:
                return zlib.decompress(rest[1:]).decode("latin-1")
        offset += 12 + length
    return None
