"""The guard (Config.guard): a lossy plan checked on a slice of the training batch and mended until the worst
LoRA-gradient cosine meets the bound; said in the report, raised in strict mode, re-checked in training."""

import pytest
import torch

import fxmem
from fxmem import guard as guard_module
from fxmem.config import Config
from fxmem.cost_model.plan import Action
from fxmem.cost_model.planner import less_lossy
from fxmem.fallback import FallbackError, FallbackWarning
from fxmem.guard import GuardedCall, check_plan, guard, slice_batch
from fxmem.measure import gradient_fidelity
from tests.models import GUARD_LLAMA

# 1-bit codes everywhere bend the tiny Llama's gradients (worst cosine about 0.6 on real text)
BENDING = {"bits": 1, "qkv_bits": None, "linear_input_bits": None, "guard_cosine": 0.99}


def llama():
    return GUARD_LLAMA.build()


def guarded(model, **options):
    """compile_'s guarded model, its graphs run without code generation (seconds, not inductor's tens)."""
    backend = fxmem.Backend(Config.from_preset("hyclora-4bit", **options), lowering="eager")
    model.compile(backend=backend)
    guard(model, backend)
    return backend


def gradients(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return grads


def test_less_lossy_raises_each_width_a_notch_and_ends_exact():
    widths = []
    config = Config.from_preset("hyclora-4bit", bits=1, qkv_bits=None)
    while config is not None:
        widths.append((config.bits, config.qkv_bits, config.linear_input_bits))
        config = less_lossy(config)
    assert widths == [(1, None, 4), (2, None, 8), (4, None, 8), (8, None, 8)]
    assert less_lossy(Config()) is None
    loract = less_lossy(Config.from_preset("loract", lowrank=0.125))
    assert (loract.lowrank, loract.bits) == (0.25, 8)
    assert less_lossy(loract).lowrank is None and less_lossy(loract).bits == 8
    assert less_lossy(Config(lowrank=2)).lowrank == 4
    assert less_lossy(Config.from_preset("hyclora-4bit", attn_sparsity=0.02)).attn_sparsity == 0.04
    assert less_lossy(Config.from_preset("hyclora-4bit", attn_sparsity=0.3)).attn_sparsity is None


def test_a_bent_plan_is_mended_on_the_slice_and_the_models_state_is_left_as_it_was():
    model, batch = llama()
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.full_like(p, 3.0)  # a gradient accumulated before: the guard must not touch it
    rng = torch.get_rng_state()
    demotions = {}
    check = check_plan(model, batch, Config.from_preset("hyclora-4bit", **BENDING), demotions)
    assert check.cosine_before < 0.9 and check.cosine_after >= 0.99 and check.met
    assert check.tokens == 64 and demotions and {d.tensor for d in check.demotions} == set(demotions)
    assert all(d.alone_cosine < 1.0 and d.before.startswith("1-bit codes") for d in check.demotions)
    assert all(p.grad.eq(3.0).all() for p in model.parameters() if p.requires_grad)
    assert torch.equal(torch.get_rng_state(), rng)
    assert "0.99" in check.summary() and "->" in check.summary()


def test_demoting_q_under_an_integer_rank_ends_exact():
    # loract keeps q, k and v at 8-bit codes: an integer rank's doubling never raises their bytes
    model, batch = llama()
    config = Config.from_preset("loract", lowrank=2)
    q = next(s for s in fxmem.inspect(model, config=config, guard=False, **batch).regions[0].saved
             if s.feeds_attention == "q")
    backend = fxmem.Backend(config, lowering="eager", demotions={q.key: 1})
    torch.compile(model, backend=backend)(**batch)
    plans = {s.key: p for r in backend.regions for s, p in zip(r.saved, r.plans, strict=True)}
    assert plans[q.key].action is Action.KEEP and backend.regions[0].demoted == {q.key: 1}


def test_a_plan_within_the_bound_is_left_alone():
    model, batch = llama()
    demotions = {}
    check = check_plan(model, batch, Config.from_preset("hyclora-4bit"), demotions)
    assert check.met and not check.demotions and not demotions and check.cosine_after == check.cosine_before


def test_compile_guards_the_training_step_and_the_report_says_what_it_demoted():
    model, batch = llama()
    reference = gradients(model, batch)
    backend = fxmem.compile_(model, "hyclora-4bit", guard_every=2, **BENDING)
    assert isinstance(model._compiled_call_impl, GuardedCall)
    got = [gradients(model, batch) for _ in range(3)]
    assert gradient_fidelity(reference, got[0]).min_cosine >= 0.99  # on the whole batch, not the slice alone
    assert [(c.forward, c.why) for c in backend.guard_checks] == [(1, "first forward"), (3, "every 2 forwards")]
    assert not backend.guard_checks[1].demotions  # the mended plan holds
    demoted = {key for region in backend.regions for key in region.demoted}
    assert demoted == set(backend.demotions)
    report = backend.report()
    notes = report.guard_notes()
    assert len(notes) == 2 and "nothing demoted" in notes[1] and "1-bit codes ->" in notes[0]
    assert report.to_dict()["guard"][0]["demotions"] and "guard at forward 1" in report.table()
    with torch.no_grad():  # not training: no check
        model(**batch)
    assert len(backend.guard_checks) == 2


def test_a_guarded_config_compiled_without_compile_says_no_check_ran():
    model, batch = llama()
    backend = fxmem.Backend(Config.from_preset("hyclora-4bit"), lowering="eager")
    torch.compile(model, backend=backend)(**batch).loss.backward()
    assert backend.report().guard_notes() == [(
        "guard: no check of this plan ran (the guard checks training batches through fxmem.compile_ and "
        "fxmem.inspect; torch.compile(model, backend=...) hands fxmem graphs, not batches)")]


def test_without_the_guard_nothing_is_checked():
    model, _ = llama()
    backend = fxmem.compile_(model, "hyclora-4bit", **{**BENDING, "guard": False})
    assert not isinstance(model._compiled_call_impl, GuardedCall)
    assert not backend.guard_checks and backend.report().guard_notes() == []
    fxmem.compile_(model, "exact")  # nothing lossy: nothing to guard
    assert not isinstance(model._compiled_call_impl, GuardedCall)


def test_a_demotion_found_by_a_recheck_recompiles_the_model_and_warns(monkeypatch):
    model, batch = llama()
    reference = gradients(model, batch)
    backend = guarded(model, guard_every=1, **BENDING)
    real_check = guard_module.check_plan
    # as though the plan had met the bound at first and drifted since: the first check demotes nothing
    monkeypatch.setattr(guard_module, "check_plan", lambda model, batch, config, demotions, **kwargs: (
        guard_module.GuardCheck(1, "first forward", 64, config.guard_cosine, 1.0, 1.0, "")))
    assert gradient_fidelity(reference, gradients(model, batch)).min_cosine < 0.9
    monkeypatch.setattr(guard_module, "check_plan", real_check)
    regions = len(backend.regions)
    with pytest.warns(UserWarning, match="the model compiles again with them"):
        grads = gradients(model, batch)
    assert backend.guard_checks[1].demotions and len(backend.regions) > regions
    assert gradient_fidelity(reference, grads).min_cosine >= 0.99  # this very step runs the mended plan


def test_strict_mode_raises_where_the_bound_cannot_be_met(monkeypatch, lenient):
    monkeypatch.setattr(guard_module, "MAX_ROUNDS", 1)
    model, batch = llama()
    guarded(model, strict=True, **BENDING)
    with pytest.raises(FallbackError, match=r"stays 0\.\d+ below the bound 0.99"):
        model(**batch)
    model, batch = llama()
    guarded(model, **BENDING)
    with pytest.warns(FallbackWarning, match="below the bound 0.99"):
        model(**batch).loss.backward()


def test_a_batch_the_guard_cannot_check_is_noted_and_training_goes_on(lenient):
    model, batch = llama()
    backend = guarded(model)
    with pytest.warns(FallbackWarning, match="not checked: TypeError: the model's output has no loss"):
        output = model(input_ids=batch["input_ids"])  # no labels: no loss to differentiate
    assert output.logits.shape[:2] == batch["input_ids"].shape
    assert "not checked: TypeError: the model's output has no loss" in backend.report().guard_notes()[0]
    model, batch = llama()
    guarded(model, strict=True)
    with pytest.raises(FallbackError, match="not checked"):
        model(input_ids=batch["input_ids"])
    model, batch = llama()
    backend = guarded(model)
    masked = batch["labels"].clone()
    masked[:, :64] = -100  # a prompt masked past the slice: no supervised token to compare on
    with pytest.warns(FallbackWarning, match="not checked: no nonzero, finite gradient on the slice"):
        model(input_ids=batch["input_ids"], labels=masked)
    assert not backend.guard_checks[0].met and not backend.demotions


def test_positional_arguments_are_checked_by_their_names():
    model, batch = llama()
    backend = guarded(model, **BENDING)
    model(batch["input_ids"], labels=batch["labels"]).loss.backward()
    assert backend.guard_checks[0].demotions and not backend.guard_checks[0].note


def test_the_slice_is_each_rows_first_tokens():
    ids = torch.arange(2 * 1024).reshape(2, 1024)
    sliced, tokens = slice_batch({"input_ids": ids, "labels": ids, "attention_mask": torch.ones(2, 1024),
                                  "scale": torch.ones(3), "flag": True})
    assert tokens == 128 and sliced["input_ids"].shape == sliced["attention_mask"].shape == (2, 128)
    assert sliced["scale"].shape == (3,) and sliced["flag"] is True and torch.equal(sliced["labels"], ids[:, :128])
    assert slice_batch({"input_ids": ids[:, :100]})[1] == 64 and slice_batch({"input_ids": ids[:, :40]})[1] == 40
    with pytest.raises(ValueError, match="needs a batch of keyword tensors of \\(rows, tokens\\)"):
        slice_batch({"pixel_values": torch.ones(3)})


def test_inspect_shows_the_mended_plan():
    model, batch = llama()
    report = fxmem.inspect(model, config=Config.from_preset("hyclora-4bit", **BENDING), **batch)
    assert report.guard_checks and report.guard_checks[0].demotions
    assert {key for region in report.regions for key in region.demoted} == \
        {d.tensor for d in report.guard_checks[0].demotions}


def _rank(rank, world, store, out):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, batch = llama()
    batch = {k: v[rank:rank + 1] for k, v in batch.items()}  # each rank its own row
    demotions = {}
    check = check_plan(model, batch, Config.from_preset("hyclora-4bit", **BENDING), demotions)
    torch.save((demotions, check.cosine_before, check.cosine_after), out / f"{rank}.pt")
    torch.distributed.destroy_process_group()


def test_ranks_measure_their_own_rows_and_demote_the_same(tmp_path):
    torch.multiprocessing.spawn(_rank, args=(2, tmp_path / "store", tmp_path), nprocs=2)
    first, second = (torch.load(tmp_path / f"{rank}.pt") for rank in range(2))
    assert first == second and first[0] and first[1] < 0.9 and first[2] >= 0.99


@pytest.mark.parametrize(("options", "message"), [
    ({"guard_cosine": 0}, r"guard_cosine must be a number in \(0, 1.0\]"),
    ({"guard_cosine": 1.5}, r"guard_cosine must be a number in \(0, 1.0\]"),
    ({"guard_every": 0}, "guard_every must be an integer number of training forwards >= 1 or None"),
    ({"guard": "yes"}, "guard must be True or False"),
])
def test_bad_guard_settings_are_refused_clearly(options, message):
    with pytest.raises(ValueError, match=message):
        Config.from_preset("hyclora-4bit", **options)


def test_the_lossy_presets_guard_at_their_published_bounds():
    from fxmem.config import PRESETS, PUBLISHED_MIN_COSINE

    assert {name for name, config in PRESETS.items() if config.guard} == {"hyclora-4bit", "hyclora-2bit", "loract"}
    assert all(PRESETS[name].guard_cosine == PUBLISHED_MIN_COSINE[name] for name in ("hyclora-4bit", "loract"))
