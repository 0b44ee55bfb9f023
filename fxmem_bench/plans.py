"""`fxmem bench plans`: golden plans. Every saved tensor's plan on a fixed set of tiny configurations, dumped to
benchmarks/plans.json and compared against it, so that a change that moves a plan shows in the diff of its commit.

Each configuration is a tiny model (PEFT LoRA r=8 on every linear of a random-weight transformers model: Llama with
4, 2 or 1 key/value heads, Qwen3, Gemma, BERT, GPT-2; hidden 64, 2 layers, dropout off), a Config (a preset and overrides, strict: a fallback
fails the dump instead of dumping the plan that fell back) and a batch of random token ids. ``dump`` traces each with
``fxmem.inspect`` (eager lowering: seconds a model) and keeps, per region and per saved tensor that frees memory (the
tensors inspect's table lists), the plan's structural fields: the tensor's role and bytes, the plan's action and
what it stores (bits, channels, outliers, chunk, rotation, rank, kept values, exact channels, the node compressed
instead), the bytes it leaves on the device and whether it waits in host memory. Never its reason or price: they
carry measured figures.

The planner's prices read the machine's speeds (cost_model/prices.py measures the memory bandwidth and the fp32
matmul rate once per process) and runlora="time" times LoRA orders (cost_model/lora_timing.py): a dump made on a
fast machine would not match one made on a slow or loaded one. ``reference_machine`` pins them while dumping to
REFERENCE_MACHINE, a fixed profile the dump's header records: every binding of those functions in fxmem's modules
answers the profile's constant instead, and runlora="time" gets runlora="flops"'s orders. Any other timing during
the dump (fxmem.timing's ``step_times`` and ``interleaved_step_times``, what every measured choice times with)
raises, naming what to pin here. Whether a device has bf16 tensor cores (lora_half_products="auto") is a rule on the
device, the same on every CPU.

This module imports no torch at import time: the `fxmem bench plans` parser takes its configuration names from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fxmem.config import Config

if TYPE_CHECKING:
    import torch

    from fxmem.report import Report

HIDDEN, LAYERS, HEADS, VOCAB, LORA_RANK, LORA_ALPHA = 64, 2, 4, 256, 8, 32
BATCH, SEQ = 2, 16
HEADER = "_header"  # the dump's one key that is no configuration (configuration names start with a letter)
DEFAULT_FILE = pathlib.Path("benchmarks") / "plans.json"
WRITE_COMMAND = "fxmem bench plans --write"

# The reference machine the dump is planned for: the prices' measured speeds as constants (a CPU of a few cores).
REFERENCE_MACHINE = {"memory_bandwidth": 20e9, "matmul_rate": 100e9, "runlora_time": "runlora='flops' orders"}

# Each family's LoRA targets: every linear of its blocks (GPT-2's Conv1D store W transposed: fan_in_fan_out)
_DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_TARGETS = {"llama": _DECODER_LINEARS, "qwen3": _DECODER_LINEARS, "gemma": _DECODER_LINEARS,
                 "bert": ("query", "key", "value", "dense"), "gpt2": ("c_attn", "c_proj", "c_fc")}


@dataclass(frozen=True)
class TinyModel:
    """A tiny transformers model with PEFT LoRA on every linear, random weights from a fixed seed."""

    family: str  # one of _LORA_TARGETS
    kv_heads: int = HEADS  # Llama's key/value heads: fewer than HEADS is grouped-query attention
    attention: str = "sdpa"  # transformers' attn_implementation
    dtype: str = "float32"  # the model's; PEFT keeps the adapters in float32 (autocast_adapter_dtype)

    def build(self, batch: int, seq: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """The model in training mode, and a batch of ``batch`` x ``seq`` random token ids with labels."""
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import (
            BertConfig,
            BertForSequenceClassification,
            GemmaConfig,
            GemmaForCausalLM,
            GPT2Config,
            GPT2LMHeadModel,
            LlamaConfig,
            LlamaForCausalLM,
            Qwen3Config,
            Qwen3ForCausalLM,
        )

        torch.manual_seed(0)
        generator = torch.Generator().manual_seed(1)
        ids = torch.randint(0, VOCAB, (batch, seq), generator=generator)
        batch_inputs = {"input_ids": ids, "labels": ids}
        decoder = {"hidden_size": HIDDEN, "intermediate_size": 172, "num_hidden_layers": LAYERS,
                   "num_attention_heads": HEADS, "num_key_value_heads": self.kv_heads, "vocab_size": VOCAB,
                   "attn_implementation": self.attention, "use_cache": False}
        if self.family == "llama":
            model = LlamaForCausalLM(LlamaConfig(**decoder))
        elif self.family == "qwen3":  # an RMSNorm over each head of q and k
            model = Qwen3ForCausalLM(Qwen3Config(head_dim=HIDDEN // HEADS, **decoder))
        elif self.family == "gemma":  # RMSNorms scaling by 1 + weight
            model = GemmaForCausalLM(GemmaConfig(head_dim=HIDDEN // HEADS, **decoder))
        elif self.family == "bert":
            model = BertForSequenceClassification(BertConfig(
                hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                vocab_size=VOCAB, attn_implementation=self.attention, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0))
            batch_inputs["labels"] = torch.randint(0, 2, (batch,), generator=generator)
        elif self.family == "gpt2":
            model = GPT2LMHeadModel(GPT2Config(
                n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, use_cache=False, bos_token_id=0,
                eos_token_id=0, attn_implementation=self.attention, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0))
            model.loss_type = "ForCausalLM"  # avoids the graph break on a warning_once in the loss lookup
        else:
            raise ValueError(f"unknown family {self.family!r}; valid families: {', '.join(_LORA_TARGETS)}")
        model.to(getattr(torch, self.dtype))
        model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA,
                                                 target_modules=list(_LORA_TARGETS[self.family]), lora_dropout=0.0,
                                                 fan_in_fan_out=self.family == "gpt2"))
        model.train()
        return model, batch_inputs


@dataclass(frozen=True)
class PlanConfiguration:
    """One configuration of the dump: a tiny model, a preset and its overrides, a batch shape."""

    name: str
    model: TinyModel
    preset: str = "exact"
    overrides: tuple[tuple[str, Any], ...] = ()
    batch: tuple[int, int] = (BATCH, SEQ)

    def config(self) -> Config:
        return Config.from_preset(self.preset, strict=True, **dict(self.overrides))

    def definition(self) -> dict[str, Any]:
        """What the configuration is, as the dump records it beside its plans."""
        return {"model": dataclasses.asdict(self.model), "preset": self.preset, "overrides": dict(self.overrides),
                "batch": list(self.batch)}


LLAMA, BERT, GPT2 = TinyModel("llama"), TinyModel("bert"), TinyModel("gpt2")
GQA2, GQA1 = TinyModel("llama", kv_heads=2), TinyModel("llama", kv_heads=1)
LLAMA_EAGER, LLAMA_BF16 = TinyModel("llama", attention="eager"), TinyModel("llama", dtype="bfloat16")
QWEN3, GEMMA, GPT2_BF16 = TinyModel("qwen3", kv_heads=2), TinyModel("gemma"), TinyModel("gpt2", dtype="bfloat16")

CONFIGURATIONS: tuple[PlanConfiguration, ...] = (
    # every preset on Llama
    PlanConfiguration("llama-exact", LLAMA),
    PlanConfiguration("llama-hyclora-4bit", LLAMA, "hyclora-4bit"),
    PlanConfiguration("llama-hyclora-2bit", LLAMA, "hyclora-2bit"),
    # loract on fp32 at 2 x 64 tokens: with fewer rows than channels (2 x 16) each tensor's codes beat its factors
    PlanConfiguration("llama-loract", LLAMA, "loract", batch=(BATCH, 4 * SEQ)),
    PlanConfiguration("llama-runlora", LLAMA, "runlora"),
    PlanConfiguration("llama-runlora-time", LLAMA, "runlora", (("runlora", "time"),)),  # pinned: as "flops"
    # grouped-query attention, other families
    PlanConfiguration("gqa2-hyclora-4bit", GQA2, "hyclora-4bit"),
    PlanConfiguration("gqa2-loract", GQA2, "loract", batch=(BATCH, 4 * SEQ)),
    PlanConfiguration("gqa1-hyclora-4bit", GQA1, "hyclora-4bit"),
    PlanConfiguration("qwen3-hyclora-2bit", QWEN3, "hyclora-2bit"),  # q/k norms: their inputs at qkv_bits
    PlanConfiguration("gemma-hyclora-4bit", GEMMA, "hyclora-4bit"),  # norm inputs rebuilt through 1 + weight
    PlanConfiguration("bert-exact", BERT),
    PlanConfiguration("bert-hyclora-4bit", BERT, "hyclora-4bit"),
    PlanConfiguration("gpt2-exact", GPT2),
    PlanConfiguration("gpt2-hyclora-4bit", GPT2, "hyclora-4bit"),
    # quantization and low-rank options
    PlanConfiguration("hyclora-4bit-qkv-bits-none", LLAMA, "hyclora-4bit", (("qkv_bits", None),)),
    PlanConfiguration("hyclora-2bit-linear-input-bits-none", LLAMA, "hyclora-2bit", (("linear_input_bits", None),)),
    PlanConfiguration("hyclora-4bit-no-rebuild-from-x", LLAMA, "hyclora-4bit", (("rebuild_from_x", False),)),
    PlanConfiguration("hyclora-4bit-rotation", LLAMA, "hyclora-4bit", (("rotation", 16),
                                                                       ("stochastic_rounding", True))),
    PlanConfiguration("loract-no-prenorm-sharing", LLAMA, "loract", (("prenorm_sharing", False),),
                      batch=(BATCH, 4 * SEQ)),
    PlanConfiguration("lowrank-rank-4-bits-4", LLAMA, "exact", (("lowrank", 4), ("bits", 4))),
    # chunked ops, checkpointed and offloaded blocks
    PlanConfiguration("hyclora-4bit-mlp-chunk", LLAMA, "hyclora-4bit", (("mlp_chunk", 8),)),
    PlanConfiguration("hyclora-4bit-norm-chunk", LLAMA, "hyclora-4bit", (("norm_chunk", 8),)),
    PlanConfiguration("hyclora-4bit-linear-chunk", LLAMA, "hyclora-4bit", (("linear_chunk", 8),)),
    PlanConfiguration("exact-auto", LLAMA, "exact", (("block_checkpoint", "auto"), ("mlp_chunk", "auto"),
                                                     ("norm_chunk", "auto"), ("linear_chunk", "auto"))),
    PlanConfiguration("exact-block-checkpoint", LLAMA, "exact", (("block_checkpoint", True),)),
    PlanConfiguration("hyclora-4bit-block-checkpoint", LLAMA, "hyclora-4bit", (("block_checkpoint", True),)),
    PlanConfiguration("hyclora-4bit-block-input-bits-4", LLAMA, "hyclora-4bit", (("block_checkpoint", True),
                                                                                 ("block_input_bits", 4))),
    PlanConfiguration("hyclora-4bit-block-offload", LLAMA, "hyclora-4bit", (("block_checkpoint", True),
                                                                            ("block_offload", True))),
    # memory budgets
    PlanConfiguration("budget-0.6", LLAMA, "exact", (("memory_budget", 0.6),)),
    PlanConfiguration("budget-0.3", LLAMA, "exact", (("memory_budget", 0.3),)),
    # two layers' equal moves: taken in graph order, whatever PYTHONHASHSEED is
    PlanConfiguration("qwen3-budget-0.3", QWEN3, "exact", (("memory_budget", 0.3),)),
    PlanConfiguration("budget-0.2", LLAMA, "exact", (("memory_budget", 0.2),)),
    PlanConfiguration("budget-0.3-blocks", LLAMA, "exact", (("memory_budget", 0.3), ("block_checkpoint", True),
                                                            ("block_offload", True))),
    # eager attention (the presets sparsify its probabilities); a bf16 model with PEFT's fp32 adapters
    PlanConfiguration("eager-attention-hyclora-4bit", LLAMA_EAGER, "hyclora-4bit"),
    PlanConfiguration("bf16-hyclora-4bit", LLAMA_BF16, "hyclora-4bit"),
    PlanConfiguration("bf16-loract", LLAMA_BF16, "loract"),
    PlanConfiguration("gpt2-bf16-hyclora-4bit", GPT2_BF16, "hyclora-4bit"),  # LayerNorm inputs rebuilt + mean
)
CONFIGURATION_NAMES = tuple(c.name for c in CONFIGURATIONS)


def get_configurations(names: Sequence[str] | None = None) -> list[PlanConfiguration]:
    """The configurations named, in CONFIGURATIONS' order (every one for None); an unknown name raises ValueError
    naming the valid ones."""
    if names is None:
        return list(CONFIGURATIONS)
    unknown = [n for n in names if n not in CONFIGURATION_NAMES]
    if unknown:
        raise ValueError(f"unknown configuration(s) {', '.join(unknown)}; valid configurations: "
                         f"{', '.join(CONFIGURATION_NAMES)}")
    return [c for c in CONFIGURATIONS if c.name in names]


@contextlib.contextmanager
def reference_machine() -> Iterator[None]:
    """Plan as on REFERENCE_MACHINE: the measured speeds pinned, runlora="time" answered by the flops rule, and any
    other timing raising (it would be a measured input the profile does not pin)."""
    from unittest import mock

    import fxmem.inspection  # noqa: F401 (loads every pass: their bindings of the pinned functions are patched)
    from fxmem import timing
    from fxmem.cost_model import lora_orders, lora_timing, prices

    def unpinned(name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"fxmem.timing.{name} ran while dumping golden plans: a measured input to planning "
                               f"that the reference machine does not pin; pin it in fxmem_bench/plans.py "
                               f"(reference_machine)")
        return refuse

    pins = {prices.memory_bandwidth: lambda device="cpu": REFERENCE_MACHINE["memory_bandwidth"],
            prices.matmul_rate: lambda device="cpu": REFERENCE_MACHINE["matmul_rate"],
            lora_timing.choose_by_time: lambda shape, needs=frozenset(lora_orders.GRADIENTS), device="cpu":
                lora_orders.choose_by_flops(shape, needs),
            timing.step_times: unpinned("step_times"),
            timing.interleaved_step_times: unpinned("interleaved_step_times")}
    by_identity = {id(measured): pinned for measured, pinned in pins.items()}
    with contextlib.ExitStack() as stack:
        for module in [m for name, m in list(sys.modules.items()) if name == "fxmem" or name.startswith("fxmem.")]:
            for attribute, value in list(vars(module).items()):
                if id(value) in by_identity:  # every binding: a module's `from ... import memory_bandwidth` too
                    stack.enter_context(mock.patch.object(module, attribute, by_identity[id(value)]))
        yield


def dump(configurations: Sequence[PlanConfiguration],
         progress: Callable[[PlanConfiguration], None] = lambda configuration: None) -> dict[str, Any]:
    """Each configuration's definition and plans, planned on the reference machine, by name; ``progress`` is called
    before each."""
    import torch

    from fxmem.inspection import inspect

    plans = {}
    with reference_machine():
        for configuration in configurations:
            progress(configuration)
            torch._dynamo.reset()  # each model is a new one of a class dynamo may have compiled: no recompile limit
            model, batch = configuration.model.build(*configuration.batch)
            report = inspect(model, config=configuration.config(), guard=False, **batch)
            plans[configuration.name] = {**configuration.definition(), "regions": _region_records(report)}
        torch._dynamo.reset()
    return plans


# Plan fields left out: the reason and the price carry measured figures; nbytes is planned_bytes + host_bytes
_NOT_STRUCTURAL = ("reason", "seconds", "nbytes")


def _region_records(report: Report) -> list[dict[str, Any]]:
    from fxmem.cost_model import host_bytes, planned_bytes

    regions = []
    for region in report.regions:
        saved = {}
        for record, plan in zip(region.saved, region.plans, strict=True):
            if not record.frees_memory:  # parameters and inputs: never planned, as inspect's table leaves them out
                continue
            if record.name in saved:
                raise ValueError(f"region {region.index} saves two tensors named {record.name}")
            facts = {"rebuilt_for": record.rebuilt_for, "shares_storage_with": record.shares_storage_with,
                     "host_bytes": host_bytes(record, plan)}
            saved[record.name] = {"role": record.role.value, "bytes": record.nbytes,
                                  **{k: v for k, v in plan.to_dict().items() if k not in _NOT_STRUCTURAL},
                                  "planned_bytes": planned_bytes(record, plan),
                                  **{k: v for k, v in facts.items() if v}}
        regions.append({"index": region.index, "kind": region.kind, "budget_bytes": region.budget_bytes,
                        "activation_bytes": sum(s["bytes"] for s in saved.values()),
                        "planned_bytes": sum(s["planned_bytes"] for s in saved.values()),
                        "host_bytes": sum(s.get("host_bytes", 0) for s in saved.values()), "saved": saved})
    return regions


def header() -> dict[str, Any]:
    """The dump's header: what it is, how it is rewritten, the machine profile it is planned for, and the versions
    it was written with (told when a check fails: a version may rename graph nodes)."""
    import peft
    import torch
    import transformers

    return {"about": "fxmem's plan of every saved tensor on tiny configurations (fxmem_bench/plans.py); a change "
                     f"that moves a plan rewrites this file with `{WRITE_COMMAND}` in the same commit",
            "reference_machine": REFERENCE_MACHINE,
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__}}


def dump_text(header_record: Mapping[str, Any], plans: Mapping[str, Any]) -> str:
    """The file's text: sorted keys, one configuration a top-level key, the header first."""
    return json.dumps({HEADER: header_record, **plans}, sort_keys=True, indent=1) + "\n"


def differences(expected: Mapping[str, Any], plans: Mapping[str, Any], *,
                every_configuration: bool) -> dict[str, list[str]]:
    """What differs between a dump's contents (``expected``, header included) and freshly dumped ``plans``, per
    configuration (HEADER for the header): readable lines, none where they match. ``every_configuration``: the
    plans are every configuration's, so a dump's configuration not among them is stale."""
    found: dict[str, list[str]] = {}
    profile = expected.get(HEADER, {}).get("reference_machine")
    if profile != REFERENCE_MACHINE:
        found[HEADER] = [f"reference machine {profile} -> {REFERENCE_MACHINE}"]
    for name, plan in plans.items():
        if name not in expected:
            found[name] = ["missing from the dump"]
        elif lines := _configuration_differences(expected[name], plan):
            found[name] = lines
    if every_configuration:
        for name in expected:
            if name != HEADER and name not in plans:
                found[name] = ["stale: in the dump, but no configuration of fxmem_bench/plans.py has this name"]
    return found


def _configuration_differences(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    lines = [f"{key}: {expected.get(key)} -> {actual.get(key)}" for key in ("model", "preset", "overrides", "batch")
             if expected.get(key) != actual.get(key)]
    old_regions = {r["index"]: r for r in expected.get("regions", [])}
    new_regions = {r["index"]: r for r in actual["regions"]}
    for index in sorted(old_regions.keys() | new_regions.keys()):
        old, new = old_regions.get(index), new_regions.get(index)
        if old is None or new is None:
            lines.append(f"region {index}: {'new' if old is None else 'gone'}")
            continue
        lines += [f"region {index} {key}: {old.get(key)} -> {new.get(key)}" for key in sorted(old.keys() | new.keys())
                  if key != "saved" and old.get(key) != new.get(key)]
        for tensor in sorted(old["saved"].keys() | new["saved"].keys()):
            before, after = old["saved"].get(tensor), new["saved"].get(tensor)
            if before == after:
                continue
            if before is None or after is None:
                lines.append(f"region {index} {tensor}: {_describe(before)} -> {_describe(after)}")
                continue
            changed = [f"{key} {before.get(key, '-')} -> {after.get(key, '-')}"
                       for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]
            lines.append(f"region {index} {tensor} ({before.get('role')}, {before.get('action')}): "
                         + "; ".join(changed))
    return lines


def _describe(entry: Mapping[str, Any] | None) -> str:
    if entry is None:
        return "(not saved)"
    return " ".join(f"{key}={value}" for key, value in sorted(entry.items()))
