from fxmem import cli
from fxmem.cost_model.lora_orders import LoraShape
from fxmem_bench import lora_layer

SHAPE = LoraShape(32, 24, 40, 4)


def test_lora_layer_reports_the_median_of_per_round_ratios_and_their_quartiles(monkeypatch, tmp_path, capsys):
    # Round 3 is slow for all (the machine's drift): its ratio is 1.0 although the medians alone read 2.0 / 1.5.
    times = {"peft": [2.0, 2.0, 9.0, 2.0, 2.0], "runlora": [1.0, 1.6, 9.0, 1.0, 1.25],
             "runlora, aten": [2.0, 1.6, 9.0, 1.6, 2.0]}
    timed = []

    def interleaved(steps_by_name, **_):
        timed.append(sorted(steps_by_name))
        return {name: times[name] for name in steps_by_name}

    monkeypatch.setattr(lora_layer, "interleaved_step_times", interleaved)
    monkeypatch.setattr(lora_layer, "weight_libraries", lambda x, weight: ("onednn", "aten"))
    timing = lora_layer.time_lora_layer(SHAPE, steps=5)
    assert timed == [["peft", "runlora", "runlora, aten"]]
    assert timing.speedups == (2.0, 1.25, 1.0, 2.0, 1.6)
    assert timing.speedup == 1.6
    assert timing.speedup_quartiles == (1.25, 2.0)
    assert timing.order_speedups == (1.0, 1.25, 1.0, 1.25, 1.0) and timing.order_speedup == 1.0
    markdown = tmp_path / "table.md"
    assert cli.main(["bench", "lora", "--shapes", "32,24,40,4", "--steps", "5", "--markdown", str(markdown)]) == 0
    assert ("| 32, 24 -> 40, r=4 | forward2/backward1 | onednn/aten | +1.5% | 2000.0 ms | 1250.0 ms | 1.60x | "
            "1.25-2.00x | 1.00x |") in markdown.read_text()
    # where aten runs both products, "orders only" is runlora itself: no third candidate
    monkeypatch.setattr(lora_layer, "weight_libraries", lambda x, weight: ("aten", "aten"))
    timing = lora_layer.time_lora_layer(SHAPE, steps=5)
    assert timed[-1] == ["peft", "runlora"] and timing.order_speedups == timing.speedups
