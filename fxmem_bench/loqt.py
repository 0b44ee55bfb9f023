"""`fxmem bench loqt`: LoQT measured on the benchmark workloads.

- pretrain: a random-init Llama on real text, the paper's ablation side by side
  (full training, LoQT-nq, LoQT, LoQT without error compensation, LoQT with a
  fixed merge interval), every setting from the same weights on the same batches.
- finetune: a pretrained workload (minilm-real), LoQT against PEFT LoRA.
- memory: bytes of the converted layers' weights, trainable parameters and
  AdamW state, for full training, LoRA and LoQT, on the real model.

Each run trains on the workload's first ``steps`` batches and is scored on the
``eval_batches`` that follow them (never trained on), under no_grad.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fxmem.measure import format_bytes
from fxmem.models import LORA_TARGETS
from fxmem.train.hift import optimizer_state_bytes, tensor_bytes
from fxmem.train.loqt import LoQT, LoQTConfig, convert, loqt_layers, weight_nbytes
from fxmem_bench.workloads import Setup, Workload

Batch = dict[str, torch.Tensor]
OnStep = Callable[[str, int, float], None]


@dataclass(frozen=True)
class Setting:
    name: str
    method: str  # full | lora | loqt
    config: LoQTConfig | None = None  # loqt
    lora_rank: int = 0  # lora


def pretrain_settings(rank: int, *, scale: float, first_interval: int) -> list[Setting]:
    """Full training and the paper's ablation (Figure 4) at one rank, every linear of every block converted."""
    loqt = LoQTConfig(rank=rank, target=LORA_TARGETS["llama"], scale=scale, first_interval=first_interval)
    return [
        Setting("full training", "full"),
        Setting("LoQT-nq", "loqt", dataclasses.replace(loqt, quantize=False, quantize_projection=False)),
        Setting("LoQT", "loqt", loqt),
        Setting("LoQT, no compensation", "loqt", dataclasses.replace(loqt, compensation_steps=0)),
        Setting("LoQT, fixed interval", "loqt", dataclasses.replace(loqt, schedule="fixed")),
    ]


def finetune_settings(workload: Workload, rank: int, *, scale: float, first_interval: int) -> list[Setting]:
    """PEFT LoRA against LoQT and LoQT-nq at the same rank on the same linears, and LoQT at twice the rank
    (LoRA's trainable parameter count on square layers: LoQT trains r * max(in, out), LoRA r * (in + out))."""
    loqt = LoQTConfig(rank=rank, target=LORA_TARGETS[workload.family], scale=scale, first_interval=first_interval)
    return [Setting(f"LoRA r={rank}", "lora", lora_rank=rank), Setting(f"LoQT r={rank}", "loqt", loqt),
            Setting(f"LoQT-nq r={rank}", "loqt", dataclasses.replace(loqt, quantize=False, quantize_projection=False)),
            Setting(f"LoQT r={2 * rank}", "loqt", dataclasses.replace(loqt, rank=2 * rank))]


@dataclass
class RunResult:
    setting: str
    losses: list[float]  # training loss of every step
    eval_loss: float
    first_eval_loss: float  # before the first step (after conversion)
    trainable_params: int
    weight_bits: float  # stored bits per parameter of W in the targeted linears
    optimizer_state_bytes: int  # the most AdamW held after a step
    merge_steps: list[int]
    seconds: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _eval_loss(setup: Setup, model: nn.Module, batches: list[Batch]) -> float:
    with torch.no_grad():
        return sum(setup.loss(model, b).item() for b in batches) / len(batches)


def loqt_weight_bits(model: nn.Module) -> float:
    """Stored bits per parameter of the LoQT layers' W (NF4 codes and scales, or the unquantized dtype)."""
    layers = loqt_layers(model).values()
    return 8 * weight_nbytes(model)["weight"] / sum(layer.in_features * layer.out_features for layer in layers)


def warmup_cosine(steps: int) -> Callable[[int], float]:
    """The paper's learning-rate schedule: linear warm-up over 10% of the steps, cosine decay to 10%."""
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(workload: Workload, setting: Setting, *, steps: int, lr: float, loqt_lr: float, eval_batches: int = 8,
          adapter_only: bool, seed: int = 0, on_step: OnStep = lambda name, step, loss: None) -> RunResult:
    """One setting: build, convert (LoQT) or wrap (LoRA), train ``steps`` AdamW steps, score.

    The workload's batch stream is split: the first ``steps`` batches train, the next ``eval_batches`` score,
    and LoQT's merges take their gradient batches after those, so every setting trains on the same batches.
    ``adapter_only``: only B (or LoRA) trains, as fine-tuning; otherwise every parameter outside the converted
    linears trains too, at ``lr`` (pretraining with full-rank embeddings, as the paper). B trains at ``loqt_lr``.
    """
    setup = workload.build(lora_rank=setting.lora_rank, seed=seed)
    model = setup.model
    merges = len(setting.config.merge_steps(steps)) + 1 if setting.config else 0
    batches = [next(setup.batches) for _ in range(steps + eval_batches + merges)]
    train_batches, held_out, gradient_batches = (batches[:steps], batches[steps:steps + eval_batches],
                                                 iter(batches[steps + eval_batches:]))
    weight_bits = 8.0 * next(model.parameters()).element_size()

    def gradient_loss(m: nn.Module) -> torch.Tensor:
        return setup.loss(m, next(gradient_batches))

    if setting.method == "loqt":
        if adapter_only:
            model.requires_grad_(False)
        convert(model, setting.config, gradient_loss)
        weight_bits = loqt_weight_bits(model)
    b_params = [layer.b for layer in loqt_layers(model).values()]
    b_ids = {id(p) for p in b_params}
    others = [p for p in model.parameters() if p.requires_grad and id(p) not in b_ids]
    groups = [{"params": others, "lr": lr}] if others else []
    groups += [{"params": b_params, "lr": loqt_lr}] if b_params else []
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps))
    state_bytes = []

    def measure_state(optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        state_bytes.append(optimizer_state_bytes(optimizer, model.parameters()))

    optimizer.register_step_post_hook(measure_state)  # before LoQT's hook: B's state is measured before a reset
    loqt = LoQT(model, setting.config, optimizer, gradient_loss) if setting.method == "loqt" else None
    first_eval = _eval_loss(setup, model, held_out)
    merge_steps, losses = [], []
    start = time.perf_counter()
    for step, batch in enumerate(train_batches, 1):
        loss = setup.loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for group in groups for p in group["params"]], 1.0)
        merged = loqt.merges if loqt else 0
        optimizer.step()  # LoQT merges here, after the scheduled steps
        if loqt and loqt.merges > merged:
            merge_steps.append(step)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        on_step(setting.name, step, losses[-1])
    seconds = time.perf_counter() - start
    return RunResult(setting=setting.name, losses=losses, eval_loss=_eval_loss(setup, model, held_out),
                     first_eval_loss=first_eval,
                     trainable_params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                     weight_bits=weight_bits, optimizer_state_bytes=max(state_bytes),
                     merge_steps=merge_steps, seconds=seconds)


@dataclass
class MemoryRow:
    method: str
    trainable_params: int
    optimizer_state_bytes: int  # AdamW, measured after one step
    weight_params: int  # parameters of W in the targeted linears
    weight_bytes: int  # their stored bytes
    projection_bytes: int  # LoQT's P
    adapter_bytes: int  # LoRA's A and B, or LoQT's B

    @property
    def weight_bits(self) -> float:
        return 8 * self.weight_bytes / self.weight_params

    @property
    def layer_bits(self) -> float:
        """Everything the targeted linears store (W, P, the adapter) per parameter of W."""
        return 8 * (self.weight_bytes + self.projection_bytes + self.adapter_bytes) / self.weight_params

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "weight_bits": self.weight_bits, "layer_bits": self.layer_bits}


def memory_settings(workload: Workload, *, lora_rank: int, loqt_rank: int, pretrain_rank: int
                    ) -> list[tuple[Setting, bool]]:
    """(setting, adapter_only): full training, LoRA, LoQT fine-tuning (only B) and pretraining (B and the rest)."""
    target = LORA_TARGETS[workload.family]
    return [(Setting("full training", "full"), False),
            (Setting(f"LoRA r={lora_rank}", "lora", lora_rank=lora_rank), True),
            (Setting(f"LoQT r={loqt_rank}, only B trains", "loqt", LoQTConfig(rank=loqt_rank, target=target)), True),
            (Setting(f"LoQT r={pretrain_rank}, B + embeddings, norms, head train", "loqt",
                     LoQTConfig(rank=pretrain_rank, target=target)), False)]


def memory_row(workload: Workload, setting: Setting, *, adapter_only: bool) -> MemoryRow:
    """Build the real model, convert or wrap it, and count; one AdamW step on zero gradients sizes its state.

    LoQT's first projection needs a gradient: it comes from a 1 x 64-token batch (the bytes do not depend on it).
    """
    small = dataclasses.replace(workload, batch=1, seq=64)
    setup = small.build(lora_rank=setting.lora_rank)
    model = setup.model
    if setting.method == "loqt":
        if adapter_only:
            model.requires_grad_(False)
        convert(model, setting.config, lambda m: setup.loss(m, next(setup.batches)))
        stored = weight_nbytes(model)
        layers = loqt_layers(model).values()
        weight_params = sum(layer.in_features * layer.out_features for layer in layers)
        weight_bytes, projection_bytes, adapter_bytes = stored["weight"], stored["projection"], stored["b"]
    else:
        selector = LoQTConfig(rank=1, target=rf"{LORA_TARGETS[workload.family]}(\.base_layer)?")
        weights = [m.weight for name, m in model.named_modules() if selector.selects(name, m)]
        weight_params = sum(w.numel() for w in weights)
        weight_bytes = tensor_bytes(weights)
        projection_bytes = 0
        adapter_bytes = tensor_bytes(p for name, p in model.named_parameters() if ".lora_" in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return MemoryRow(method=setting.name, trainable_params=sum(p.numel() for p in trainable),
                     optimizer_state_bytes=optimizer_state_bytes(optimizer, trainable), weight_params=weight_params,
                     weight_bytes=weight_bytes, projection_bytes=projection_bytes, adapter_bytes=adapter_bytes)


RUN_COLUMNS = ("setting", "eval loss", "vs {reference}", "eval loss at start", "train loss, last 10", "merges",
               "trainable params", "W bits/param", "optimizer state", "time")
MEMORY_COLUMNS = ("method", "trainable params", "vs full", "optimizer state", "W bits/param",
                  "W + P + adapter bits/param")


def run_rows(results: list[RunResult], reference: RunResult) -> list[list[str]]:
    """RUN_COLUMNS for each result, losses relative to ``reference``'s."""
    rows = []
    for r in results:
        tail = r.losses[-10:]
        relative = "—" if r is reference else f"{(r.eval_loss - reference.eval_loss) / reference.eval_loss:+.2%}"
        rows.append([r.setting, f"{r.eval_loss:.4f}", relative, f"{r.first_eval_loss:.4f}",
                     f"{sum(tail) / len(tail):.4f}", str(len(r.merge_steps)), f"{r.trainable_params:,}",
                     f"{r.weight_bits:.3f}", format_bytes(r.optimizer_state_bytes), f"{r.seconds:.0f} s"])
    return rows


def memory_rows(rows: list[MemoryRow]) -> list[list[str]]:
    full = rows[0]
    return [[r.method, f"{r.trainable_params:,}", f"{r.trainable_params / full.trainable_params:.2%}",
             format_bytes(r.optimizer_state_bytes), f"{r.weight_bits:.3f}", f"{r.layer_bits:.3f}"] for r in rows]
