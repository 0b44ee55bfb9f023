"""`fxmem bench ablate`: the accuracy side of a lossy preset, as HyC-LoRA's Table 1 and LoRAct's Tables 3-4 report it.

Each setting fine-tunes the same workload from the same weights on the same
batches (round-robin, as `fxmem bench finetune`), next to eager PEFT and
torch.compile. Reported per setting: saved-activation bytes, gradient fidelity
(every trainable gradient on a fixed probe batch against the eager model's at
the same weights, probed through training) and the final loss against
torch.compile's, the uncompressed run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fxmem.config import Config
from fxmem.measure import Fidelity
from fxmem.timing import median, warm_up_compiler
from fxmem_bench.finetune import FinetuneRun, round_robin
from fxmem_bench.workloads import Workload


@dataclass(frozen=True)
class Setting:
    name: str
    method: str  # eager | compile | fxmem
    config: Config = field(default_factory=Config)


DEFAULT_BITS = (4, 2)
ROTATION = 64  # Hadamard block of the rotated settings
DEFAULT_RATIOS = (0.5, 0.25, 0.125, 0.0625)  # the ratios; the paper's Table 1 goes down to 1/64


def hyclora_settings(bits: Sequence[int] = DEFAULT_BITS) -> list[Setting]:
    """The baselines, then per bit width the paper's Table 1 rows: intra + inter, intra-operator only with and
    without outliers (channels and values), inter-operator only, intra + inter with each of our options (Hadamard
    rotation in blocks of ROTATION, stochastic rounding, and rebuilt from x: the preset); and for the first bit
    width two of the paper's choices we depart from: q/k/v at that bit width too (we keep them at 8), and static
    calibration (scales frozen, values outside clamped; we recompute them every batch)."""
    _check_unique("bits", bits)
    settings = [Setting("eager PEFT", "eager"), Setting("torch.compile", "compile")]
    for b in bits:
        # as the presets run them (lora_half_products: a bf16 model's LoRA products in bf16 on tensor cores)
        paper = Config(bits=b, lora_reorder=True, lora_half_products="auto")
        intra = paper.replace(lora_reorder=False)
        settings += [Setting(f"{b}-bit intra + inter", "fxmem", paper),
                     Setting(f"{b}-bit intra", "fxmem", intra),
                     Setting(f"{b}-bit intra, no outliers", "fxmem",
                             intra.replace(outlier_ratio=0.0, outlier_values=0.0)),
                     Setting(f"{b}-bit inter", "fxmem", paper.replace(intra=False)),
                     Setting(f"{b}-bit intra + inter, rotated", "fxmem", paper.replace(rotation=ROTATION)),
                     Setting(f"{b}-bit intra + inter, stochastic", "fxmem", paper.replace(stochastic_rounding=True)),
                     Setting(f"{b}-bit intra + inter, rebuilt from x", "fxmem", paper.replace(rebuild_from_x=True))]
    first = Config(bits=bits[0], lora_reorder=True, lora_half_products="auto")
    settings.append(Setting(f"{bits[0]}-bit intra + inter, q/k/v {bits[0]}-bit", "fxmem",
                            first.replace(qkv_bits=None)))
    settings.append(Setting(f"{bits[0]}-bit intra + inter, static", "fxmem", first.replace(calibration="static")))
    return settings


def loract_settings(ratios: Sequence[float | int] = DEFAULT_RATIOS) -> list[Setting]:
    """The baselines, then per rank ratio three settings: the preset at that ratio ("pre-norm": a norm's input
    rebuilt from its output's factors; q, k, v at 8-bit codes, every other tensor the smaller of its factors
    and its 8-bit codes); "layer-wise", the same without pre-norm sharing (each norm's input stored on its own,
    the paper's layer-wise baseline of Tables 3-4); and "q/k/v factored", the preset without codes (bits=None:
    every tensor factored, q, k and v too, as the paper does)."""
    _check_unique("ratios", ratios)
    settings = [Setting("eager PEFT", "eager"), Setting("torch.compile", "compile")]
    for ratio in ratios:
        preset = Config.from_preset("loract", lowrank=ratio)
        settings += [Setting(f"lowrank {ratio}, pre-norm", "fxmem", preset),
                     Setting(f"lowrank {ratio}, layer-wise", "fxmem", preset.replace(prenorm_sharing=False)),
                     Setting(f"lowrank {ratio}, q/k/v factored", "fxmem", preset.replace(bits=None))]
    return settings


def _check_unique(name: str, values: Sequence[object]) -> None:
    """Each value names its settings: a repeated one would make two settings of one name."""
    repeated = sorted({str(v) for v in values if list(values).count(v) > 1})
    if repeated:
        raise ValueError(f"{name}: each value once; repeated: {', '.join(repeated)}")


def select_settings(settings: Sequence[Setting], names: Sequence[str]) -> list[Setting]:
    """The baselines and the named settings, in ``settings``' order."""
    valid = [s.name for s in settings if s.method == "fxmem"]
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown setting {', '.join(map(repr, unknown))}; valid settings: "
                         f"{', '.join(map(repr, valid))}")
    return [s for s in settings if s.method != "fxmem" or s.name in names]


@dataclass
class AblationResult:
    setting: str
    saved_bytes: int
    losses: list[float]
    step_seconds: float
    probes: list[Fidelity]  # empty for the baselines
    evaluation: tuple[float, float] | None = None  # (eval loss, next-token accuracy), where the workload has them

    @property
    def final_loss(self) -> float:
        tail = self.losses[-5:]
        return sum(tail) / len(tail)

    @property
    def min_cosine(self) -> float | None:
        return min(p.min_cosine for p in self.probes) if self.probes else None

    @property
    def median_error(self) -> float | None:
        return median(p.median_relative_error for p in self.probes) if self.probes else None

    def to_dict(self) -> dict:
        return {"setting": self.setting, "saved_bytes": self.saved_bytes, "final_loss": self.final_loss,
                "step_seconds": self.step_seconds, "min_cosine": self.min_cosine,
                "median_relative_error": self.median_error, "probes": [p.to_dict() for p in self.probes],
                "losses": self.losses,
                **({"eval_loss": self.evaluation[0], "eval_accuracy": self.evaluation[1]} if self.evaluation else {})}


def probe_steps(steps: int, calibration_steps: int) -> list[int]:
    """Right after calibration, mid-way and at the end."""
    return sorted({min(steps, calibration_steps + 1), max(1, steps // 2), steps})


def ablate(workload: Workload, settings: Sequence[Setting], *, steps: int, lr: float = 1e-3,
           device: torch.device | str = "cpu", lora_rank: int = 16,
           on_step: Callable[[str, int, float], None] = lambda name, step, loss: None) -> list[AblationResult]:
    if steps < 3:
        raise ValueError(f"steps must be >= 3; got {steps}")
    torch._dynamo.reset()
    warm_up_compiler()
    runs = [FinetuneRun(workload, s.method, config=s.config, lr=lr, device=device, lora_rank=lora_rank)
            for s in settings]
    probes: list[list[Fidelity]] = [[] for _ in runs]
    # Every setting compiles the same model class: past dynamo's recompile limit (8) the rest would silently
    # run eager and report uncompressed numbers.
    limit = max(torch._dynamo.config.recompile_limit, len(settings))
    with torch._dynamo.config.patch(recompile_limit=limit):
        for step, index in round_robin(len(runs), steps):
            run, setting = runs[index], settings[index]
            on_step(setting.name, step, run.step())
            if setting.method == "fxmem" and step in probe_steps(steps, setting.config.calibration_steps):
                probes[index].append(run.gradient_probe())
    torch._dynamo.reset()
    results = []
    for setting, run, fidelity in zip(settings, runs, probes, strict=True):
        r = run.result()
        # The trained weights, read by the plain model: compression changes training, not inference.
        evaluation = run.setup.evaluate(run.setup.model) if run.setup.evaluate else None
        results.append(AblationResult(setting.name, r.saved_bytes, r.losses, r.step_seconds, fidelity, evaluation))
    return results
