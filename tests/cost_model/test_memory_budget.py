"""memory_budget: from the exact plan, the planner spends each region down to its target over typed options, one
rule for all (cost_model.budget.fit_budget): the least error class first (exact: recompute, replay, offload; then
quantization, least sensitive tensors first; then low-rank factors), the fewest seconds per byte saved within it."""

import importlib
import re

import pytest
import torch

import fxmem
from fxmem.analysis import Role
from fxmem.cost_model.plan import Action
from fxmem.measure import gradient_fidelity
from tests.conftest import compiled_step, loss_and_grads, randomize_lora_b, tiny_model

LADDER_BUDGET = 0.15


def _budget_run(config):
    model, batch = tiny_model("llama", lora=True)
    randomize_lora_b(model)
    backend = fxmem.Backend(config, lowering="eager")
    saved, _, grads = compiled_step(model, batch, backend)
    torch._dynamo.reset()
    [region] = backend.report().regions
    return saved, grads, region


def _quantized(region):
    return [(s, p) for s, p in zip(region.saved, region.plans, strict=True) if p.action is Action.QUANTIZE and s.nbytes]


def _compile_saved():
    model, batch = tiny_model("llama", lora=True)
    saved, _, _ = compiled_step(model, batch, "inductor")
    torch._dynamo.reset()
    return saved


def _planned(region):
    return sum(fxmem.cost_model.planned_bytes(s, p) for s, p in zip(region.saved, region.plans, strict=True))


def test_a_fraction_is_of_what_torch_compile_saves_and_is_spent_on_free_recomputation_then_8_bits():
    exact_saved, exact_grads, _ = _budget_run(fxmem.Config())
    saved, grads, region = _budget_run(fxmem.Config(memory_budget=0.6))
    assert region.budget_bytes == pytest.approx(0.6 * _compile_saved(), rel=0.02)
    assert saved == _planned(region) <= region.budget_bytes < exact_saved
    assert any(n.startswith("memory_budget 0.6: planned") for n in region.notes), region.notes
    spent = [(s, p) for s, p in zip(region.saved, region.plans, strict=True) if p.reason.endswith("(memory_budget)")]
    recomputed = [p for _, p in spent if p.action is Action.RECOMPUTE]
    assert recomputed and all(p.reason.startswith("rebuilt element-wise") for p in recomputed)  # exact, nearly free
    quantized = _quantized(region)
    assert all(p.bits == 8 and p.reason.endswith("(memory_budget)") for _, p in quantized)
    # linear, activation and product inputs suffice here: norm inputs and q, k, v stay exact
    assert {s.role for s, _ in quantized} <= {Role.LINEAR_INPUT, Role.ACT_INPUT, Role.PRODUCT_INPUT}
    # q, k and v stay exact, so attention's output is saved as torch saves it: no attention forward in backward
    passes = {p.name: p.note for p in region.passes}
    assert passes["recompute_attention"] == "not run: q, k and v stay exact under memory_budget"
    assert any(s.role is Role.ATTN_OUT for s in region.saved)
    assert gradient_fidelity(exact_grads, grads).min_cosine > 0.999


def test_a_budget_in_bytes_is_the_target_itself():
    saved, _, region = _budget_run(fxmem.Config(memory_budget=200_000))
    assert region.budget_bytes == 200_000
    assert saved == _planned(region) <= 200_000


def test_an_unreachable_budget_takes_every_quantizable_tensor_to_2_bits_warns_and_still_trains():
    with pytest.warns(UserWarning, match=r"memory_budget 0.01 not met: planned [\d.]+ MiB saved against a target of "
                                         r"[\d.]+ MiB \(\d+\.\d% of the [\d.]+ MiB torch.compile saves\)"):
        saved, grads, region = _budget_run(fxmem.Config(memory_budget=0.01))
    quantized = _quantized(region)
    assert {p.bits for _, p in quantized} == {2}
    assert {Role.ATTN_QKV, Role.NORM_INPUT, Role.LINEAR_INPUT} <= {s.role for s, _ in quantized}
    assert saved == _planned(region)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_the_ladder_finishes_each_stage_before_the_next_and_lowers_q_k_v_last():
    from fxmem.cost_model.error import BUDGET_STAGES
    _, _, region = _budget_run(fxmem.Config(memory_budget=LADDER_BUDGET))  # reaches q, k, v at 4 bits here
    sensitivity = {Role.ATTN_QKV: 3, Role.LINEAR_INPUT: 2, Role.NORM_INPUT: 1}  # no lora_reorder: no X W here
    bits = {s.name: (p.bits, sensitivity.get(s.role, 0)) for s, p in _quantized(region)}
    reached = max(BUDGET_STAGES.index((b, group)) for b, group in bits.values())
    assert reached >= BUDGET_STAGES.index((4, 3))
    # q, k and v compressed: attention reruns in backward on the values backward uses, its output not saved
    passes = {p.name: p.note for p in region.passes}
    assert passes["recompute_attention"].startswith("2 attention op(s) recomputed in backward (about ")
    assert not any(s.role is Role.ATTN_OUT for s in region.saved)
    for stage_bits, group in BUDGET_STAGES[:reached]:
        assert all(b <= stage_bits for b, g in bits.values() if g == group), (stage_bits, group, bits)


def test_attention_is_recomputed_only_in_the_layers_whose_q_k_v_the_budget_compresses(monkeypatch):
    # the ladder's budget compresses both layers' q, k and v; the first plan is read as if it had compressed only
    # layer 0's: attention reruns there alone, and layer 1 saves its q, k, v and output exact
    import importlib
    pipeline = importlib.import_module("fxmem.pipeline")
    first = "base_model.model.model.layers.0"
    monkeypatch.setattr(pipeline.Partition, "compressed_attention_layers", lambda self: frozenset({first}))
    _, exact_grads, _ = _budget_run(fxmem.Config())
    with pytest.warns(UserWarning, match="not met"):  # layer 1's q, k and v kept exact: the target is out of reach
        _, grads, region = _budget_run(fxmem.Config(memory_budget=LADDER_BUDGET))
    passes = {p.name: p.note for p in region.passes}
    assert passes["recompute_attention"].startswith("1 attention op(s) recomputed in backward (about ")
    assert passes["recompute_attention"].endswith("; 1 left saving q, k, v and the output exact (memory_budget: "
                                                  "their q, k and v stay exact)")
    attention_inputs = {(s.layer, p.action) for s, p in zip(region.saved, region.plans, strict=True)
                        if s.feeds_attention is not None and s.frees_memory}
    assert {action for layer, action in attention_inputs if layer != first} == {"keep"}
    assert {action for layer, action in attention_inputs if layer == first} == {"quantize"}
    # layer 1's output (and log-sum-exp) saved, layer 0's not
    assert {s.layer for s in region.saved if s.role is Role.ATTN_OUT} == {"base_model.model.model.layers.1"}
    # layer 1's attention runs on exact q, k, v: its LoRA gradients are closer to exact than under this budget with
    # every layer recomputed from compressed q, k, v (q and k: 0.88, 0.92 here against 0.76, 0.78)
    layer_1 = {n: g for n, g in exact_grads.items() if "layers.1.self_attn" in n}
    assert gradient_fidelity(layer_1, {n: grads[n] for n in layer_1}).min_cosine > 0.85


def test_a_budget_plans_from_the_exact_plan_and_the_presets_structural_passes_stay():
    preset = fxmem.Config.from_preset("hyclora-4bit")
    _, _, plain = _budget_run(preset)
    _, _, loose = _budget_run(preset.replace(memory_budget=1.0))
    assert {p.action for p in plain.plans} >= {"quantize"}
    assert "quantize" not in {p.action for p in loose.plans}  # torch.compile's bytes need no compression
    assert any(n.startswith("memory_budget 1: planned") for n in loose.notes)
    saved, _, tight = _budget_run(preset.replace(memory_budget=0.3))
    assert saved == _planned(tight) <= tight.budget_bytes
    assert {p.bits for _, p in _quantized(tight)} <= {8, 4, 2}
    # lora_reorder's X W stays where the preset put it
    assert any(s.role is Role.LORA_BASE_OUTPUT for s in tight.saved) == any(
        s.role is Role.LORA_BASE_OUTPUT for s in plain.saved)


def test_x_w_rebuilt_for_gelu_or_tanh_stays_at_8_bits_under_any_budget():
    model, batch = tiny_model("bert", lora=True)
    backend = fxmem.Backend(fxmem.Config(bits=8, lora_reorder=True, intra=False, memory_budget=0.01),
                            lowering="eager")
    with pytest.warns(UserWarning, match="memory_budget 0.01 not met"):
        compiled_step(model, batch, backend)
    rebuilt = {s.detail.removeprefix("output rebuilt for "): getattr(p, "bits", None)
               for _, s, p in backend.report().rows() if s.role is Role.LORA_BASE_OUTPUT and s.nbytes}
    assert rebuilt["gelu"] == 8
    assert rebuilt["tanh"] is None  # the pooler's 2 x 64 X W: quantizing would not shrink it
    assert {bits for kind, bits in rebuilt.items() if kind not in ("gelu", "tanh")} == {2}


def _exact_grads():
    _, grads, _ = _budget_run(fxmem.Config())
    return grads


def test_exact_options_come_first_an_x_w_replayed_from_its_x_before_any_quantization():
    # hyclora-4bit's rebuild_from_x: its q, k, v X W are rebuilt from their x by a matmul, exact; with the
    # element-wise recomputations that meets 0.6 of torch.compile's bytes with nothing rounded
    saved, grads, region = _budget_run(fxmem.Config.from_preset("hyclora-4bit", memory_budget=0.6))
    assert saved == _planned(region) <= region.budget_bytes
    assert not _quantized(region)
    replayed = [(s, p) for s, p in zip(region.saved, region.plans, strict=True)
                if p.reason.startswith("rebuilt in backward as x W^T from")]
    assert replayed and all(s.role is Role.LORA_BASE_OUTPUT and p.action is Action.RECOMPUTE and p.seconds > 0
                            for s, p in replayed)
    assert gradient_fidelity(_exact_grads(), grads).min_cosine > 0.9999


def test_the_x_an_x_w_is_replayed_from_stays_at_8_bits_however_tight_the_budget():
    # planned twice (the replayed X W are no longer saved the second time): the analysis' rebuild sources keep x's
    # floor, else the second plan would round x to 2 bits under the replay's exact X W
    with pytest.warns(UserWarning, match="memory_budget 0.15 not met"):
        saved, _, region = _budget_run(fxmem.Config.from_preset("hyclora-4bit", memory_budget=0.15))
    plans = {s.name: p for s, p in zip(region.saved, region.plans, strict=True)}
    sources = {re.search(r"x W\^T from (\S+) and", p.reason).group(1) for p in region.plans
               if p.reason.startswith("rebuilt in backward as x W^T")}
    assert sources and all(plans[x].action is Action.KEEP or plans[x].bits >= 8 for x in sources)
    assert {p.bits for s, p in _quantized(region) if s.name not in sources} == {2}  # the rest went to 2 bits
    assert saved == _planned(region)


def test_low_rank_factors_come_after_every_quantizable_tensor_reaches_2_bits():
    _, _, reachable = _budget_run(fxmem.Config(lowrank=1, memory_budget=0.3))
    assert "lowrank" not in {p.action for p in reachable.plans} and _quantized(reachable)
    with pytest.warns(UserWarning, match="memory_budget 0.05 not met"):
        saved, _, region = _budget_run(fxmem.Config(lowrank=1, memory_budget=0.05))
    factored = [p for p in region.plans if p.action is Action.LOWRANK]
    assert factored and all(p.rank == 1 and p.reason.endswith("(memory_budget)") for p in factored)
    assert {p.bits for _, p in _quantized(region)} <= {2}  # rank-1 factors of these rows are fewer bytes than 2 bits
    assert saved == _planned(region) < _planned(reachable)


def test_a_checkpointed_blocks_input_waits_in_host_memory_before_anything_is_rounded(monkeypatch):
    config = fxmem.Config(block_checkpoint=True, block_offload=True, memory_budget=0.1)
    # on a CPU the host is the device: offloading would meet the target in name only, so the budget rounds instead
    _, _, on_cpu = _budget_run(config)
    assert not any(p.host for p in on_cpu.plans) and _quantized(on_cpu)
    monkeypatch.setattr(fxmem.cost_model.budget, "_host_apart", lambda owner: True)  # as on a GPU
    saved, grads, region = _budget_run(config)
    offloaded = [p for p in region.plans if p.host]
    assert offloaded and all("in host memory between forward and backward" in p.reason for p in offloaded)
    assert not _quantized(region)
    assert saved == _planned(region) + sum(fxmem.cost_model.host_bytes(s, p)
                                           for s, p in zip(region.saved, region.plans, strict=True))
    assert _planned(region) <= region.budget_bytes
    assert gradient_fidelity(_exact_grads(), grads).min_cosine > 0.9999


def _block_summaries(region):
    return {p.name: p.note for p in region.passes if p.name in ("checkpoint_blocks", "recompute_attention")}


def test_a_block_checkpoint_is_one_of_the_budgets_exact_options_taken_block_by_block():
    # the tiny Llama's two blocks: at 0.5 one checkpoint (with the element-wise recomputations) meets the target
    saved, grads, region = _budget_run(fxmem.Config(block_checkpoint=True, memory_budget=0.5))
    assert saved == _planned(region) <= region.budget_bytes
    [note] = [n for n in region.notes if n.startswith("memory_budget checkpoints ")]
    assert re.fullmatch(r"memory_budget checkpoints base_model\.model\.model\.layers\.1: a [\d.]+ ms forward for "
                        r"[\d.]+ MiB", note), note
    summaries = _block_summaries(region)
    assert summaries["checkpoint_blocks"] == (
        "1 block(s) checkpointed from their outputs, 1 tensor(s) saved between blocks; 1 left to their saved "
        "tensors' plans: memory_budget chose base_model.model.model.layers.1")
    assert summaries["recompute_attention"].endswith("1 in blocks memory_budget checkpoints whole")
    # the checkpointed block saves its output alone; the other its tensors, exact
    layers = {}
    for s in region.saved:
        if s.frees_memory:
            layers.setdefault(s.layer, []).append(s)
    assert len(layers["base_model.model.model.layers.1"]) == 1
    assert len(layers["base_model.model.model.layers.0"]) > 10
    assert not _quantized(region)
    assert gradient_fidelity(_exact_grads(), grads).min_cosine > 0.99999


def test_a_budget_met_by_cheaper_exact_options_checkpoints_no_block():
    preset = fxmem.Config.from_preset("hyclora-4bit", memory_budget=0.6)
    _, _, without = _budget_run(preset)
    _, _, region = _budget_run(preset.replace(block_checkpoint=True))
    assert _block_summaries(region)["checkpoint_blocks"] == (
        "not run: memory_budget's plan checkpoints no block")
    assert region.plans == without.plans


def test_block_checkpoints_meet_a_budget_that_rounding_alone_misses():
    preset = fxmem.Config.from_preset("hyclora-4bit", memory_budget=0.08)
    with pytest.warns(UserWarning, match="memory_budget 0.08 not met"):
        _budget_run(preset)
    saved, grads, region = _budget_run(preset.replace(block_checkpoint=True))
    assert saved == _planned(region) <= region.budget_bytes
    assert _block_summaries(region)["checkpoint_blocks"].startswith("2 block(s) checkpointed from their outputs")
    # what is left to round is the residual stream between blocks, at 8 bits (the blocks rebuild from it)
    assert {p.bits for _, p in _quantized(region)} == {8}
    assert gradient_fidelity(_exact_grads(), grads).min_cosine > 0.999


def test_what_a_checkpointed_block_is_recomputed_from_keeps_its_floor_when_the_block_before_is_not(monkeypatch):
    # the first plan is read as if it had checkpointed layer 1 alone: layer 0's output, which layer 1 is recomputed
    # from, stays at 8 bits while the rest of layer 0 goes to 2
    import importlib
    pipeline = importlib.import_module("fxmem.pipeline")
    second = "base_model.model.model.layers.1"
    monkeypatch.setattr(pipeline.Partition, "checkpointed_blocks", lambda self: {second: f"{second}: priced"})
    with pytest.warns(UserWarning, match="memory_budget 0.01 not met"):
        _, _, region = _budget_run(fxmem.Config(block_checkpoint=True, memory_budget=0.01))
    assert f"memory_budget checkpoints {second}: priced" in region.notes
    residual = sorted(getattr(p, "bits", None) for s, p in zip(region.saved, region.plans, strict=True)
                      if s.nbytes and s.module == "base_model.model.model.layers.0" and s.role is Role.NORM_INPUT)
    assert residual == [2, 8]  # the residual stream inside layer 0, and layer 0's output


def test_a_first_plan_that_fails_is_reported_and_the_region_planned_with_every_pass(lenient, monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("a planner bug")

    monkeypatch.setattr(importlib.import_module("fxmem.cost_model.budget"), "_block_options", fail)
    with pytest.warns(fxmem.FallbackWarning, match=r"memory_budget's first plan failed \(RuntimeError: a planner bug"):
        _, grads, region = _budget_run(fxmem.Config(block_checkpoint=True, memory_budget=0.5))
    assert any(n.startswith("memory_budget's first plan failed") for n in region.notes)
    assert _block_summaries(region)["checkpoint_blocks"].startswith("2 block(s) checkpointed")  # every block
    assert gradient_fidelity(_exact_grads(), grads).min_cosine > 0.99999


def test_blocks_that_draw_from_a_stateful_generator_are_not_among_the_options_and_the_report_says_so(lenient):
    # fallback_random: dropout stays aten's native_dropout, whose generator a recomputation would advance
    model, batch = tiny_model("llama", lora=True, lora_dropout=0.1)
    backend = fxmem.Backend(fxmem.Config(block_checkpoint=True, memory_budget=0.3), lowering="eager")
    with torch._inductor.config.patch(fallback_random=True):
        compiled_step(model, batch, backend)
    [region] = backend.report().regions
    assert ("block_checkpoint: 2 block(s) not among memory_budget's options: they draw random numbers "
            "(base_model.model.model.layers.0, base_model.model.model.layers.1)") in region.notes
    assert _block_summaries(region)["checkpoint_blocks"] == "not run: memory_budget's plan checkpoints no block"


def test_blocks_whose_lora_dropout_draws_from_the_steps_seeds_are_among_the_options():
    grads = {}
    for config in (fxmem.Config(), fxmem.Config(block_checkpoint=True, memory_budget=0.3)):
        model, batch = tiny_model("llama", lora=True, lora_dropout=0.1)
        randomize_lora_b(model)
        backend = fxmem.Backend(config, lowering="eager")
        _, grads[config.memory_budget] = loss_and_grads(torch.compile(model, backend=backend), model, batch, seed=3)
        torch._dynamo.reset()
    [region] = backend.report().regions
    assert _block_summaries(region)["checkpoint_blocks"].startswith("1 block(s) checkpointed from their outputs")
    # other masks in the recomputed block would bend the gradients far more (another seed: cosine 0.16)
    assert gradient_fidelity(grads[None], grads[0.3]).min_cosine > 0.9999
