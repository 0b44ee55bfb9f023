"""Golden plans (fxmem_bench/plans.py): the committed dump is what the planner plans now, a changed plan is reported
naming its tensor, and the dump does not read the machine's speed."""

import json
import pathlib

import pytest

from fxmem import cli
from fxmem_bench import plans

CHEAP = "hyclora-4bit-block-input-bits-4"  # the fastest configuration to plan (its blocks checkpointed)


@pytest.fixture(scope="module")
def committed():
    return json.loads((pathlib.Path(__file__).resolve().parents[2] / plans.DEFAULT_FILE).read_text())


def test_the_committed_dump_has_every_configuration_and_no_other(committed):
    assert set(committed) - {plans.HEADER} == set(plans.CONFIGURATION_NAMES)


# One test a configuration, so that the suite's workers share them.
@pytest.mark.parametrize("name", plans.CONFIGURATION_NAMES)
def test_the_committed_dump_is_what_the_planner_plans(committed, name):
    # A change that moves a plan rewrites the dump in the same commit: `fxmem bench plans --write`.
    found = plans.differences(committed, plans.dump(plans.get_configurations([name])), every_configuration=False)
    assert not found, "\n".join(f"{configuration}: {line}" for configuration, lines in found.items() for line in lines)


def test_a_written_dump_with_a_plan_changed_is_reported_naming_the_tensor(tmp_path, capsys):
    path = tmp_path / "plans.json"
    assert cli.main(["bench", "plans", "--write", "--only", CHEAP, "--file", str(path)]) == 0
    text = path.read_text()
    dump = json.loads(text)
    assert list(dump) == [plans.HEADER, CHEAP] and text == plans.dump_text(dump[plans.HEADER], {CHEAP: dump[CHEAP]})
    assert dump[plans.HEADER]["reference_machine"] == plans.REFERENCE_MACHINE
    capsys.readouterr()

    [region] = dump[CHEAP]["regions"]
    name, entry = next((n, e) for n, e in region["saved"].items() if e["action"] == "quantize")
    entry["bits"] = 2 if entry["bits"] != 2 else 4
    path.write_text(json.dumps(dump))
    assert cli.main(["bench", "plans", "--only", CHEAP, "--file", str(path)]) == 1  # --check is the default
    printed = capsys.readouterr().out
    assert f"region 0 {name} ({entry['role']}, quantize): bits {entry['bits']} -> " in printed
    assert "differ from" in printed and "fxmem bench plans --write" in printed


def test_a_missing_or_stale_configuration_is_a_difference():
    plan = {"model": {}, "preset": "exact", "overrides": {}, "batch": [2, 16], "regions": []}
    header = {"reference_machine": plans.REFERENCE_MACHINE}
    found = plans.differences({plans.HEADER: header, "gone": plan}, {"new": plan}, every_configuration=True)
    assert found == {"new": ["missing from the dump"],
                     "gone": ["stale: in the dump, but no configuration of fxmem_bench/plans.py has this name"]}
    assert plans.differences({plans.HEADER: header, "gone": plan, "new": plan}, {"new": plan},
                             every_configuration=False) == {}
    moved = dict(header, reference_machine={**plans.REFERENCE_MACHINE, "matmul_rate": 1.0})
    assert list(plans.differences({plans.HEADER: moved, "new": plan}, {"new": plan}, every_configuration=True)) == \
        [plans.HEADER]


def test_an_unknown_configuration_errors_with_the_valid_names(capsys):
    assert cli.main(["bench", "plans", "--only", "llama-exact", "no-such-configuration"]) == 2
    printed = capsys.readouterr().out
    assert "unknown configuration(s) no-such-configuration" in printed
    assert all(name in printed for name in plans.CONFIGURATION_NAMES)


def test_the_reference_machine_pins_every_measured_speed():
    from fxmem import timing
    from fxmem.cost_model import lora_orders, lora_timing, prices
    from fxmem.passes.joint import runlora

    shape = lora_orders.LoraShape(tokens=32, in_features=64, out_features=64, rank=8)
    with plans.reference_machine():
        assert prices.memory_bandwidth() == plans.REFERENCE_MACHINE["memory_bandwidth"]
        assert prices.matmul_rate("cpu") == plans.REFERENCE_MACHINE["matmul_rate"]
        assert runlora.choose_by_time(shape) == lora_orders.choose_by_flops(shape)  # the pass's own binding
        with pytest.raises(RuntimeError, match="does not pin"):
            timing.step_times(lambda: None, steps=1)
    assert runlora.choose_by_time is lora_timing.choose_by_time and timing.step_times.__module__ == "fxmem.timing"


def test_every_configuration_is_a_valid_config_and_named_once():
    assert len(plans.CONFIGURATION_NAMES) == len(set(plans.CONFIGURATION_NAMES)) >= 30
    for configuration in plans.CONFIGURATIONS:
        assert configuration.config().strict
