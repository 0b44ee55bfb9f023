"""fxmem's configuration: one validated, immutable object and its named presets."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fxmem.choices import AUTO, BITS_CHOICES, BLOCK_INPUT_BITS_CHOICES, CHUNK_OPTIONS, check_lowrank

RUNLORA_CHOICES = ("off", "flops", "time")
LORA_HALF_PRODUCTS_CHOICES = ("off", "auto", "on")
CALIBRATION_CHOICES = ("dynamic", "static")
ROTATION_CHOICES = (8, 16, 32, 64, 128, 256)

@dataclass(frozen=True)
class Config:
    """Every technique's switch. The defaults are the ``exact`` preset: nothing lossy.

    bits: quantize saved activations to 1, 2, 4 or 8 bits; None keeps them as they are.
    qkv_bits: bits for attention's q, k and v when ``bits`` is set (default 8: the softmax amplifies their
        error; see docs/quantization.md), and for what reaches them through element-wise ops alone: a q/k norm's
        input, the q/k/v projections' input (docs/analysis.md); None quantizes them to ``bits`` like the rest (the
        paper).
    linear_input_bits: the fewest bits for a linear's input when ``bits`` is set: linear inputs are quantized at
        max(bits, linear_input_bits). Default 4: the LoRA A's gradient reads its input with no operator between,
        so the input's error reaches it whole; at 2 bits it was the worst gradient (see docs/quantization.md).
        None quantizes them at ``bits`` like the rest (the paper).
    outlier_ratio: fraction of norm-input channels kept in full precision when quantizing.
    outlier_values: about this fraction of the values of each tensor quantized at 2 bits or fewer is kept exact
        beside the codes (dense-and-sparse): of each row, the value of every chunk of channels farthest from its
        channel's mean in standard deviations, the chunk the power of two nearest 1 / outlier_values (0.02: 64
        channels, 1.6%). 0 is off. (At these widths each channel's grid is fitted to the batch either way:
        kernels.quantize.FITTED_SPREADS.)
    rotation: rotate each quantized tensor's rows in blocks of this many channels (a power of two from 8 to 256) by
        a fixed randomized Hadamard matrix before quantizing, and back after restoring: outliers spread over the
        block (kernels/quantize.py). A tensor whose channels no such block divides gets the largest power of two
        that does, or none below 8. None is off.
    stochastic_rounding: round codes down or up at random, with the probability of the distance (an unbiased
        restore inside the grid, a larger error per batch). False rounds to nearest.
    attn_sparsity: fraction of eager attention's probabilities stored, the largest of each row (HyC-LoRA's
        pruning); None is off, and then a compressing preset rebuilds them in backward from q and k
        (passes/joint/recompute_attention.py). A fixed count a row bounds nothing of the probability mass it drops where
        attention is spread out (a random-weight model, a long context): off in every preset, and the report says
        so where it is set.
    calibration_steps: training forwards that gather quantization statistics before freezing them.
    calibration: "dynamic" recomputes scales and outlier channels from every batch; "static" freezes
        them after calibration_steps (the paper; values outside the calibrated range are clamped).
    lora_reorder: for a LoRA linear feeding SiLU/GELU, a Hadamard product or attention, save X W (quantized
        to ``bits``) and X A (exact) and rebuild the output and its element-wise epilogue in backward
        (HyC-LoRA's inter-operator compression). Needs ``bits``. GELU, tanh and ReLU consumers only at 8 bits or
        with ``rebuild_from_x`` (cost_model.options.rebuild_refusal says why).
    rebuild_from_x: with ``lora_reorder``, rebuild in backward from a LoRA linear's input x, stored at 8 bits
        for it, what would be saved below 8 bits: an X W, by replaying its matmul with the frozen weight (one
        matmul per such layer; an aten mm or addmm, not a QLoRA 4-bit base), and, where x is a norm's output, the
        norm's input, by dividing out gamma and rstd (cost_model.planner.fit_ceilings). Fewer bytes and a far
        closer gradient on a pretrained model (SwiGLU's backward multiplies the two rebuilt values, so each one's
        rounding reached the other's gradient whole), for the matmuls' time. Without lora_reorder nothing is
        rebuilt; under ``memory_budget`` the replayed X W is one of the budget's exact options (x then held at
        8 bits or more), and the norm's input is not rebuilt.
    fused_epilogue: with ``lora_reorder``, on CUDA, run each rebuilt LoRA output's SwiGLU or GELU (forward and
        backward) in fxmem's hand-written Triton kernel (kernels/lora_epilogue.py) instead of inductor's code. Off by
        default: on a GPU the step ran slower with the kernels than with inductor's code (measured: docs/gpu.md).
    intra: quantize every saved activation whose role allows it (HyC-LoRA's intra-operator compression);
        False quantizes only the X W that lora_reorder saves (needs lora_reorder).
    lowrank: low-rank saved activations, as a ratio of the last dimension in (0, 1)
        or an integer rank >= 1; None is off.
    prenorm_sharing: with ``lowrank``, rebuild what a norm's backward saves from the factors of the norm's
        output (LoRAct's pre-norm sharing, section 3.3); False factors every saved tensor on its own
        (the paper's layer-wise ablation).
    runlora: how a LoRA linear's forward/backward order is chosen: "off" (as traced),
        "flops" (cost model) or "time" (measured once at compile time). When on, CPU fp32 products also run in
        the library measured faster on the machine (aten's MKL or oneDNN).
    memory_budget: the planner's target for each compiled region's saved-activation bytes: a fraction in (0, 1]
        of what torch.compile's own partition of the region saves, or an integer number of bytes (> 1). The planner
        starts from the exact plan and spends down to the target over typed options, the least error class first
        and the fewest seconds per byte saved within it: exact ones (element-wise recomputation, an X W replayed
        from its x with ``rebuild_from_x``, a block's input in host memory with ``block_offload``), then
        quantization 8, 4, 2 bits, least sensitive roles first, then ``lowrank``'s factors
        (cost_model.budget.fit_budget); the preset's structural passes (lora_reorder, the
        recomputed logits) stay, and attention is recomputed only in the layers whose q, k or v the plan
        compresses. The report says whether the target was met. None is no target: the preset's plan.
    chunk_loss: compute an LM head and its cross-entropy a chunk of tokens at a time, so that the (tokens x
        vocabulary) logits never exist whole (passes/dynamo/chunk_loss.py). Exact; on in every preset.
    mlp_chunk: run each SwiGLU MLP with a LoRA on its three linears (Llama's) this many tokens at a time, its
        input the only tensor it saves, its gate and up products recomputed in backward (passes/dynamo/chunk_mlp.py), so
        that the MLP-wide tensors, the step's largest transients at long context, are never whole. Exact up to
        rounding, for two more products per MLP; it replaces what the other techniques do inside the MLP. A
        bitsandbytes 4-bit base (QLoRA) is dequantized for the op, and again in backward
        (passes/dynamo/dequantize_bases.py). "auto": chunked where that lowers the region's predicted peak of activations
        by a tenth, at as many tokens as hold no more than the MLP's input, one choice for every "auto" chunk option
        of the region (cost_model/auto.py); the report's notes say which and why. A mixture's experts prepared
        by ``fxmem.prepare_peft`` with this config run this many tokens at a time too (under "auto", as many as
        hold no more than their input): their routed rows and products, and in backward their replay, one chunk
        at a time. None (every preset) is off.
    linear_chunk: run the PEFT LoRA linears outside a chunked MLP (an attention's projections: q, k and v, which
        read one input, as one op) this many tokens at a time in forward and backward, their input the only tensor
        they save (passes/dynamo/chunk_linears.py): in backward each holds its output gradient again in float32 for a
        float32 adapter, and d x is a sum of two products per linear made whole before they are added, the largest
        transients of a recomputed block at long context once its MLP and norms are chunked. Exact up to rounding;
        it replaces what the other techniques do to those linears. On a frozen weight, as ``mlp_chunk``: a
        bitsandbytes 4-bit base (QLoRA) is dequantized for the op, and again in backward
        (passes/dynamo/dequantize_bases.py); a linear whose output or base weight has another dtype than its input (as
        under autocast) is left as torch runs it. "auto": as ``mlp_chunk``'s, each op's chunk holding no more than
        its input. None (every preset) is off.
    norm_chunk: run each RMSNorm (Llama's form) this many tokens at a time, recomputed in backward from its input,
        the only tensor it saves (passes/dynamo/chunk_norm.py): a half-precision model's norm upcasts to float32, and its
        backward holds five float32 tensors of the hidden width at once, the largest transients of a recomputed
        block at long context. The gradients are torch's sums in another order. Under a quantizing preset the input
        is then stored at no fewer than 8 bits (the norm is rebuilt from it), where a norm's input is otherwise
        rebuilt from its output's codes: more saved bytes unless blocks are checkpointed (block_checkpoint), where
        nothing inside a block is saved. "auto": as ``linear_chunk``'s. None (every preset) is off.
    block_checkpoint: checkpoint every repeated block (``model.layers.N``) from its output: only the residual
        stream between blocks is saved (at 8 bits under a quantizing preset, or ``block_input_bits``), and backward
        recomputes each block's forward (passes/joint/checkpoint_blocks.py). The fewest saved bytes, for a forward's time again;
        with ``mlp_chunk`` the recomputed block holds one chunk of its MLP at a time. A block's dropout drawn from
        inductor's per-step seeds (LoRA's, hidden states', an eager attention's) is drawn again with the same
        masks. Under ``memory_budget`` a block's checkpoint
        is one of the budget's options instead, block by block (exact where what the block is recomputed from is
        kept exact): priced at its forward's seconds against the bytes of the block's plan then, and taken only
        where the rule picks it (the report's notes name each block chosen). "auto" (not with a budget): every block
        checkpointed where that lowers the region's predicted peak of activations by a tenth, its saved bytes and
        the transients of a recomputed block both counted (cost_model/auto.py), weighed with and without the
        "auto" chunk options; the report's notes say which and why. False (every preset) is off.
    block_input_bits: with ``block_checkpoint`` under a quantizing preset, the bits each block's stored input is
        kept at: 4 halves the bytes of the residual stream between blocks, the blocks then recomputed from a coarser
        input (docs/long-context.md measures the fidelity); None (every preset) is 8.
    block_offload: with ``block_checkpoint``, each block's stored input (its codes under a quantizing preset) is
        copied to host memory after its last forward read and back before backward's first
        (passes/partitioned/offload_blocks.py): the residual stream between blocks leaves the device, for two copies over the
        host link per block a step (on the compute stream, not overlapped). For a GPU; on a CPU the host is the
        device, and it saves nothing. The same bytes come back: the gradients do not change. Under ``memory_budget``
        it is one of the budget's exact options, taken block input by block input where it is the cheapest move,
        and only where host memory is apart from the device. False (every preset) is off.
    lora_half_products: the products of PEFT's fp32 adapters on a bf16 model (x A^T, its product with B,
        and their backward products) run with inputs in the model's dtype and float32 accumulation, as a GPU's tensor
        cores run them, each result rounded to the model's dtype (passes/partitioned/lora_half_products.py): "auto" for every
        one on a GPU with bf16 tensor cores and none elsewhere (cost_model/matmul_library.half_tensor_cores: a rule
        on the device, not a timing), "on" for every one, "off" in float32 as PEFT runs them. "auto" in the lossy presets, "off" in exact
        and runlora.
    return_logits: False returns an empty tensor where the model returns its logits (as Liger-Kernel and
        Unsloth do in training), so that chunk_loss applies to a model that returns them, such as every HF
        ``...ForCausalLM``; True keeps them, and such a loss is left whole.
    guard: check the plan on the training batch and mend it (fxmem/guard.py; ``fxmem.compile_`` runs it): at the
        first training forward, after each recompile (not under torch.distributed) and every ``guard_every`` forwards, a slice of the batch (its
        first tokens) runs eagerly and under the plan, and every trainable gradient is compared. Where the worst
        cosine is below ``guard_cosine``, each layer's compressed tensors, then each tensor of the worst layers, are
        measured alone (as ``fxmem.check_fidelity`` does) and the worst demoted, one notch at a time (more bits, then
        exact; the
        planner then weighs a replay or a recomputation against the new bytes), until the slice's worst cosine is
        within half the bound's distance from 1 (the slice is a sample of the batch). The report and ``inspect``
        list what was demoted, with the cosines before and after. On in the lossy presets.
    guard_cosine: the worst LoRA-gradient cosine against eager the guard holds: the preset's published bound in the
        lossy presets.
    guard_every: training forwards between the guard's checks after the first (its cost, amortized: docs/guard.md);
        None checks only at the first forward and after a recompile.
    strict: any fallback (a pass rolled back, a region compiled unplanned, a rewritten graph run unfused, a planned
        rewrite left undone) or unsupported pattern (one an enabled technique targets, left as torch runs it)
        raises fxmem.FallbackError, naming the pass and the reason, instead of a warning or a line in the report
        (fxmem/fallback.py). The environment variable FXMEM_STRICT=1 turns it on for every config; the chunked
        loss's blocks, compiled at their first call outside any region, follow the variable alone. False (every
        preset) is off.
    """

    bits: int | None = None
    qkv_bits: int | None = 8
    linear_input_bits: int | None = 4
    outlier_ratio: float = 0.005
    outlier_values: float = 0.02
    rotation: int | None = None
    stochastic_rounding: bool = False
    attn_sparsity: float | None = None
    calibration_steps: int = 5
    calibration: str = "dynamic"
    lora_reorder: bool = False
    rebuild_from_x: bool = False
    fused_epilogue: bool = False
    intra: bool = True
    lowrank: float | int | None = None
    prenorm_sharing: bool = True
    runlora: str = "off"
    memory_budget: float | int | None = None
    chunk_loss: bool = True
    mlp_chunk: int | Literal["auto"] | None = None
    norm_chunk: int | Literal["auto"] | None = None
    linear_chunk: int | Literal["auto"] | None = None
    block_checkpoint: bool | Literal["auto"] = False
    block_input_bits: int | None = None
    block_offload: bool = False
    lora_half_products: str = "off"
    return_logits: bool = True
    guard: bool = False
    guard_cosine: float = 0.99
    guard_every: int | None = 500
    strict: bool = False

    def __post_init__(self) -> None:
        _check_choice("bits", self.bits, BITS_CHOICES + (None,))
        _check_choice("qkv_bits", self.qkv_bits, BITS_CHOICES + (None,))
        _check_choice("linear_input_bits", self.linear_input_bits, BITS_CHOICES + (None,))
        _check_fraction("outlier_ratio", self.outlier_ratio, low_open=False, high=0.5, high_open=True,
                        allow_none=False)
        _check_fraction("outlier_values", self.outlier_values, low_open=False, high=0.5, high_open=True,
                        allow_none=False)
        if self.rotation is not None and (_is_bool(self.rotation) or self.rotation not in ROTATION_CHOICES):
            raise ValueError(f"rotation must be a power of two from 8 to 256 ({', '.join(map(str, ROTATION_CHOICES))})"
                             f" or None (off); got {self.rotation!r}")
        _check_fraction("attn_sparsity", self.attn_sparsity, low_open=True, high=1.0, high_open=False,
                        allow_none=True)
        if _is_bool(self.calibration_steps) or not isinstance(self.calibration_steps, int) \
                or self.calibration_steps < 1:
            raise ValueError(f"calibration_steps must be an integer >= 1; got {self.calibration_steps!r}")
        _check_choice("calibration", self.calibration, CALIBRATION_CHOICES)
        for name in ("lora_reorder", "rebuild_from_x", "fused_epilogue", "intra", "prenorm_sharing", "chunk_loss",
                     "return_logits", "stochastic_rounding", "block_offload", "guard", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False; got {getattr(self, name)!r}")
        if not isinstance(self.block_checkpoint, bool) and self.block_checkpoint != AUTO:
            raise ValueError(f"block_checkpoint must be True, False or {AUTO!r} (checkpointed where the step's "
                             f"predicted peak drops); got {self.block_checkpoint!r}")
        if self.block_checkpoint == AUTO and self.memory_budget is not None:
            raise ValueError("memory_budget weighs each block's checkpoint among its options already: set "
                             "block_checkpoint=True with it, not 'auto'")
        for name in ("rotation", "stochastic_rounding"):
            if getattr(self, name) not in (None, False) and self.bits is None and self.memory_budget is None:
                raise ValueError(f"{name} applies to quantized tensors: set bits (one of 1, 2, 4, 8) or "
                                 f"memory_budget too")
        if self.lora_reorder and self.bits is None:
            raise ValueError("lora_reorder stores X W quantized: set bits (one of 1, 2, 4, 8) too")
        if self.fused_epilogue and not self.lora_reorder:
            raise ValueError("fused_epilogue fuses the outputs lora_reorder rebuilds: set lora_reorder=True too")
        if not self.intra and not self.lora_reorder:
            raise ValueError("intra=False quantizes only what lora_reorder saves: set lora_reorder=True too")
        check_lowrank(self.lowrank)
        _check_choice("block_input_bits", self.block_input_bits, BLOCK_INPUT_BITS_CHOICES + (None,))
        if self.block_input_bits is not None and not (self.block_checkpoint and self.bits is not None):
            raise ValueError("block_input_bits sets the bits of a checkpointed block's stored input: set "
                             "block_checkpoint=True and bits (a quantizing preset, such as hyclora-4bit) too")
        if self.block_offload and not self.block_checkpoint:
            raise ValueError("block_offload moves a checkpointed block's stored input to host memory: set "
                             "block_checkpoint=True too")
        if not self.prenorm_sharing and self.lowrank is None:
            raise ValueError("prenorm_sharing=False turns off a part of lowrank: set lowrank too")
        _check_fraction("guard_cosine", self.guard_cosine, low_open=True, high=1.0, high_open=False,
                        allow_none=False)
        if self.guard_every is not None and (_is_bool(self.guard_every) or not isinstance(self.guard_every, int)
                                             or self.guard_every < 1):
            raise ValueError(f"guard_every must be an integer number of training forwards >= 1 or None (checked at "
                             f"the first forward and after a recompile only); got {self.guard_every!r}")
        _check_choice("runlora", self.runlora, RUNLORA_CHOICES)
        _check_choice("lora_half_products", self.lora_half_products, LORA_HALF_PRODUCTS_CHOICES)
        for name in CHUNK_OPTIONS:
            rows = getattr(self, name)
            if rows not in (None, AUTO) and (_is_bool(rows) or not isinstance(rows, int) or rows < 1):
                raise ValueError(f"{name} must be an integer number of tokens >= 1, {AUTO!r} (chunked where the "
                                 f"step's predicted peak drops) or None (off); got {rows!r}")
        if not _budget_in_bytes(self.memory_budget):
            _check_fraction("memory_budget", self.memory_budget, low_open=True, high=1.0, high_open=False,
                            allow_none=True, bytes_too=True)

    @classmethod
    def from_preset(cls, preset: str = "exact", **overrides: Any) -> Config:
        """The named preset with ``overrides`` applied (each validated)."""
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; valid presets: {', '.join(PRESETS)}")
        return PRESETS[preset].replace(**overrides)

    def replace(self, **overrides: Any) -> Config:
        """A copy with ``overrides`` applied; unknown names raise ValueError naming the valid ones."""
        valid = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(overrides) - set(valid))
        if unknown:
            raise ValueError(f"unknown fxmem option(s) {', '.join(unknown)}; valid options: "
                             f"{', '.join(valid)} (and 'preset')")
        return dataclasses.replace(self, **overrides)

    @property
    def compresses(self) -> bool:
        """Some saved tensor may be stored lossily: quantized, factored, or under a memory budget."""
        return self.bits is not None or self.lowrank is not None or self.memory_budget is not None

    def auto_options(self) -> tuple[str, ...]:
        """The options set to "auto" (cost_model/auto.py turns them on or off region by region)."""
        return tuple(name for name in ("block_checkpoint", *CHUNK_OPTIONS) if getattr(self, name) == AUTO)

    def budget_in_bytes(self) -> bool:
        """memory_budget is a number of bytes rather than a fraction."""
        return _budget_in_bytes(self.memory_budget)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def overrides_text(overrides: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> str:
    """Config overrides as a run's label names them: ", name=value" each, in order ("" for none)."""
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    return "".join(f", {name}={value!r}" for name, value in items)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if _is_bool(value) or value not in choices:
        shown = ", ".join("None" if c is None else repr(c) for c in choices)
        raise ValueError(f"{name} must be one of {shown}; got {value!r}")


def _budget_in_bytes(value: Any) -> bool:
    """memory_budget given in bytes: an integer above 1 (1 is the whole, as 1.0)."""
    return isinstance(value, int) and not _is_bool(value) and value > 1


def _check_fraction(name: str, value: Any, *, low_open: bool, high: float, high_open: bool,
                    allow_none: bool, bytes_too: bool = False) -> None:
    if value is None and allow_none:
        return
    in_range = (isinstance(value, (int, float)) and not _is_bool(value)
                and (0 < value if low_open else 0 <= value)
                and (value < high if high_open else value <= high))
    if not in_range:
        interval = f"{'(' if low_open else '['}0, {high}{')' if high_open else ']'}"
        suffix = (", an integer number of bytes > 1" if bytes_too else "") + (" or None (off)" if allow_none else "")
        raise ValueError(f"{name} must be a number in {interval}{suffix}; got {value!r}")


# The worst LoRA-gradient cosine against eager each preset is published at (README): a benchmark point of the
# preset wins nothing below it, and the lossy presets' guard holds it. hyclora: its llama-pretrained figure over 200
# steps; loract: its lowest real-text figure, llama-pretrained, rounded down (measured:
# docs/history/benchmarks-2026-11-26.md); exact and runlora compute what torch does, to rounding.
PUBLISHED_MIN_COSINE: dict[str, float] = {"exact": 0.9999, "hyclora-4bit": 0.995, "hyclora-2bit": 0.993,
                                          "loract": 0.79, "runlora": 0.9999}

PRESETS: dict[str, Config] = {
    "exact": Config(),
    # HyC-LoRA's paper keeps eager attention's 5% largest probabilities a row; a fixed count bounds nothing where
    # attention is spread out, so the presets rebuild them in backward from q and k instead (recompute_attention)
    "hyclora-4bit": Config(bits=4, lora_reorder=True, rebuild_from_x=True, lora_half_products="auto", guard=True,
                           guard_cosine=PUBLISHED_MIN_COSINE["hyclora-4bit"]),
    "hyclora-2bit": Config(bits=2, lora_reorder=True, rebuild_from_x=True, lora_half_products="auto", guard=True,
                           guard_cosine=PUBLISHED_MIN_COSINE["hyclora-2bit"]),
    # LoRAct's factors, and 8-bit codes beside them: attention's q, k and v are never factored then (propose_lowrank
    # leaves them to qkv_bits), and every other tensor takes the smaller of its factors and its codes (factors for
    # most bf16 activations; codes for fp32 ones with fewer rows than channels). GQA's narrow k and v at rank 1/8 (16
    # of 128 channels) were the worst gradients on real text (docs/loract.md).
    "loract": Config(lowrank=0.125, bits=8, lora_half_products="auto", guard=True,
                     guard_cosine=PUBLISHED_MIN_COSINE["loract"]),
    "runlora": Config(runlora="flops"),
}
