"""`fxmem bench lowrank-saved`: the bytes LoRAct's lowrank saves at each ratio, measured against the plan."""

from fxmem import cli
from fxmem_bench.lowrank_saved import measure_ratios
from tests.bench.conftest import TINY_LLAMA


def test_the_ratio_command_measures_what_the_plan_says_at_every_ratio(tiny_workloads, tmp_path, capsys):
    results = measure_ratios(TINY_LLAMA, [0.25, 0.125], lowering="eager")
    assert [r.setting for r in results] == ["eager PEFT", "0.25", "0.125"]
    eager, quarter, eighth = results
    for r in (quarter, eighth):
        assert r.saved_bytes == r.planned_bytes and r.prenorm_shared > 0 and -1 <= r.fidelity.min_cosine <= 1
    assert eighth.saved_bytes < quarter.saved_bytes < eager.saved_bytes
    table = tmp_path / "ratios.md"
    assert cli.main(["bench", "lowrank-saved", "--ratios", "0.5", "--lowering", "eager", "--markdown", str(table)]) == 0
    assert "| 0.5 |" in table.read_text() and "reduction vs eager" in capsys.readouterr().out
