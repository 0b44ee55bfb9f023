"""Without memory_budget, one rule chooses each storage's plan among typed options against its ceiling, the bytes of
the compression the config asks of it (cost_model.planner.fit_ceilings): the least error tier first (exact or 8
bits; rounded coarser; factored), then the fewest seconds per byte saved."""

import importlib

import pytest
import torch

import fxmem
from tests.conftest import tiny_model

planner = importlib.import_module("fxmem.cost_model.planner")


def _plans(family, config):
    torch._dynamo.reset()
    model, batch = tiny_model(family, lora=True)
    report = fxmem.inspect(model, **batch, config=config)
    return {s.name: p for _, s, p in report.rows()}


@pytest.fixture
def dear_recompute(monkeypatch):
    """Every element-wise recomputation priced at a second: dearer per byte than any compression here."""
    monkeypatch.setattr(planner, "recompute_seconds", lambda read, device="cpu": 1.0)


def _per_head_copies(plans):
    # GPT-2's q, k and v copied per head: rebuilt in backward from the projection's output, which is kept exact
    return {name: p for name, p in plans.items() if name.startswith("permute") and p.action != "keep"}


def test_within_a_tier_the_fewest_seconds_per_byte_wins(dear_recompute):
    # q, k and v at qkv_bits=8: their codes and their recomputation are one tier, so the price decides
    priced = _per_head_copies(_plans("gpt2", fxmem.Config(bits=4)))
    assert len(priced) == 6 and all(p.action == "quantize" and p.bits == 8 for p in priced.values())


def test_the_cheaper_exact_option_is_taken():
    recomputed = _per_head_copies(_plans("gpt2", fxmem.Config(bits=4)))
    assert len(recomputed) == 6 and all(p.action == "recompute" and p.nbytes == 0 for p in recomputed.values())
    assert all("against" in p.reason and "ms for its 8-bit codes" in p.reason for p in recomputed.values())


def test_an_exact_option_beats_coarser_codes_whatever_it_costs(dear_recompute):
    # at 4 bits the codes are a coarser tier than recomputing them exactly, dear as that is
    recomputed = _per_head_copies(_plans("gpt2", fxmem.Config(bits=4, qkv_bits=None)))
    assert len(recomputed) == 6 and all(p.action == "recompute" and p.seconds == 1.0 for p in recomputed.values())


def test_a_storage_the_config_keeps_is_not_moved():
    # exact asks for no bytes of anything: no recomputation, replay or rebuilt norm input either
    assert {p.action for p in _plans("gpt2", fxmem.Config()).values()} == {"keep"}
