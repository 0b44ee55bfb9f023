"""Without memory_budget, one rule chooses each storage's plan among typed options against its ceiling, the bytes of
the compression the config asks of it (cost_model.planner.fit_ceilings): the one solver's rule (cost_model/solve.py),
memory_budget's too: the least error class first (exact; codes by width and sensitivity; factored), then the fewest
seconds per byte saved."""

import importlib

import pytest
import torch

import fxmem
from fxmem.analysis import Role
from fxmem.analysis.recompute import rebuild_inputs
from fxmem.cost_model.plan import Action
from tests.conftest import tiny_model

planner = importlib.import_module("fxmem.cost_model.planner")
options = importlib.import_module("fxmem.cost_model.options")


def _per_head_copies(config):
    """GPT-2's q, k and v copied per head (a view or permute of c_attn's output) and not kept: rebuilt in backward
    from the projection's output, which is kept exact, or stored as codes."""
    torch._dynamo.reset()
    model, batch = tiny_model("gpt2", lora=True)
    report = fxmem.inspect(model, **batch, config=config)
    return {s.name: p for _, s, p in report.rows() if s.role is Role.ATTN_QKV and p.action is not Action.KEEP
            and s.name.startswith(("permute", "view"))}


@pytest.fixture
def dear_recompute(monkeypatch):
    """Every element-wise recomputation priced at a second: dearer per byte than any compression here."""
    monkeypatch.setattr(options, "recompute_seconds", lambda read, device="cpu": 1.0)


def test_an_exact_option_beats_8_bit_codes_whatever_it_costs(dear_recompute):
    # q, k and v at qkv_bits=8: their codes are a class above recomputing them exactly, as under memory_budget
    recomputed = _per_head_copies(fxmem.Config(bits=4))
    assert len(recomputed) == 6 and all(p.action is Action.RECOMPUTE and p.seconds == 1.0 for p in recomputed.values())


def test_the_cheaper_exact_option_is_taken():
    recomputed = _per_head_copies(fxmem.Config(bits=4))
    assert len(recomputed) == 6 and all(p.action is Action.RECOMPUTE and p.nbytes == 0 for p in recomputed.values())
    assert all("against" in p.reason and "ms for its 8-bit codes" in p.reason for p in recomputed.values())


def test_an_exact_option_beats_coarser_codes_whatever_it_costs(dear_recompute):
    # at 4 bits the codes are a coarser tier than recomputing them exactly, dear as that is
    recomputed = _per_head_copies(fxmem.Config(bits=4, qkv_bits=None))
    assert len(recomputed) == 6 and all(p.action is Action.RECOMPUTE and p.seconds == 1.0 for p in recomputed.values())


def test_a_storage_the_config_keeps_is_not_moved():
    # intra=False quantizes only the X W lora_reorder saves: replayed from x, which the config keeps exact and no
    # replay raises; the norms' inputs, kept too, are not rebuilt from their outputs
    config = fxmem.Config(bits=2, lora_reorder=True, rebuild_from_x=True, intra=False)
    torch._dynamo.reset()
    model, batch = tiny_model("llama", lora=True)
    rows = [(s, p) for _, s, p in fxmem.inspect(model, **batch, config=config).rows() if s.nbytes]
    replayed = [p for s, p in rows if s.role is Role.LORA_BASE_OUTPUT and p.action is Action.RECOMPUTE]
    assert len(replayed) == 4  # SwiGLU's gate and up in both layers; q, k and v at qkv_bits=8 keep their codes
    assert all(p.action is Action.KEEP for s, p in rows if s.role in (Role.LINEAR_INPUT, Role.NORM_INPUT))


@pytest.mark.parametrize(("family", "kv_heads", "config"), [
    ("llama", 4, fxmem.Config.from_preset("hyclora-2bit")),
    ("llama", 1, fxmem.Config.from_preset("hyclora-2bit", qkv_bits=None)),
    ("gpt2", 4, fxmem.Config.from_preset("loract")),
    ("llama", 4, fxmem.Config(bits=4, lowrank=0.05, prenorm_sharing=True, lora_reorder=True, rebuild_from_x=True)),
    ("gpt2", 4, fxmem.Config.from_preset("hyclora-4bit")),
    ("bert", 4, fxmem.Config.from_preset("hyclora-2bit")),
])
def test_every_plan_reads_what_stays_saved_as_it_needs(monkeypatch, family, kv_heads, config):
    chosen = []

    def fit_ceilings(analysis, by_storage, *args):
        plans = real(analysis, by_storage, *args)
        chosen.append((by_storage, plans))
        return plans

    real = planner.fit_ceilings
    monkeypatch.setattr(planner, "fit_ceilings", fit_ceilings)
    torch._dynamo.reset()
    model, batch = tiny_model(family, lora=True, **({"kv_heads": kv_heads} if family == "llama" else {}))
    fxmem.inspect(model, **batch, config=config, guard=False)
    kinds = set()
    for by_storage, plans in chosen:
        for storage, plan in plans.items():
            owner = by_storage[storage][0]
            if plan.action is Action.RECOMPUTE and plan.chain is owner.rebuild_product:  # an X W replayed from its x
                x = plans[options.replay_source_storage(owner, by_storage)]
                assert x.action is Action.KEEP or (x.action is Action.QUANTIZE and x.bits >= options.REBUILD_SOURCE_BITS)
            elif plan.action is Action.RECOMPUTE:  # element-wise, from storages kept exact
                assert all(plans[n.name].action is Action.KEEP for n in rebuild_inputs(plan.chain) if n.name in plans)
            elif plan.action is Action.PRENORM:  # from its output's factors, or its codes at the prenorm's width
                output = plans[plan.source]
                assert output.action is Action.LOWRANK if plan.bits is None else (
                    output.action is Action.QUANTIZE and output.bits == plan.bits >= options.REBUILD_SOURCE_BITS)
            kinds.add(plan.action)
    assert "recompute" in kinds or "prenorm" in kinds  # the rule had something to choose
