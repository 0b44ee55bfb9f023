import json

from fxmem import cli


def test_frontier_runs_every_point_in_one_process_and_says_which_budget_points_fxmem_beats(tiny_workloads, tmp_path,
                                                                                         capsys):
    out, plot = tmp_path / "frontier.json", tmp_path / "frontier.png"
    assert cli.main(["bench", "--frontier", "--workloads", "llama-tiny", "--targets", "0.5", "--steps", "1",
                     "--json", str(out), "--plot", str(plot)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    labels = [r["label"] for r in json.loads(out.read_text())["results"]]
    assert labels == ["eager", "compile", "hf-checkpointing", "compile-budget 0.5", "fxmem hyclora-4bit 0.5",
                      "fxmem hyclora-2bit"]
    assert "llama-tiny, compile-budget 0.5 (" in printed  # one verdict per compile-budget point
    assert (tmp_path / "frontier-llama-tiny.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = {r["label"]: r for r in json.loads(out.read_text())["results"]}
    # the planner meets its target: at most half of what torch.compile saves
    assert results["fxmem hyclora-4bit 0.5"]["saved_bytes"] <= 0.5 * results["compile"]["saved_bytes"]
    assert results["fxmem hyclora-4bit 0.5"]["fidelity"]["min_cosine"] > 0.999
