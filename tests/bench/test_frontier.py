import json

from fxmem import cli


def test_frontier_runs_every_point_in_one_process_and_says_which_budget_points_fxmem_beats(one_layer_workloads,
                                                                                         tmp_path, capsys):
    # one block: the command's points, verdicts, JSON and plot are what is tested; each point compiles with inductor
    out, plot = tmp_path / "frontier.json", tmp_path / "frontier.png"
    assert cli.main(["bench", "--frontier", "--workloads", "llama-tiny", "--targets", "0.5", "--steps", "3",
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
    assert (results["fxmem hyclora-4bit 0.5"]["fidelity_bound"], results["fxmem hyclora-2bit"]["fidelity_bound"],
            results["compile-budget 0.5"]["fidelity_bound"]) == (0.995, 0.993, None)
    assert "published bound" in printed


def test_a_point_below_its_published_fidelity_wins_nothing():
    from fxmem.config import PUBLISHED_MIN_COSINE
    from fxmem.measure import Fidelity
    from fxmem_bench.compare import MethodResult
    from fxmem_bench.frontier import wins

    def point(method, peak, seconds, cosine=None, label=""):
        return MethodResult("w", method, 0, peak, 0, 0.0, 0.0, Fidelity(cosine, 0.0, "p") if cosine else None,
                            step_samples=seconds, label=label or method,
                            fidelity_bound=PUBLISHED_MIN_COSINE["hyclora-4bit"] if method == "fxmem" else None)

    compiled = point("compile", 120, [1.0, 1.0, 1.0], cosine=1.0)
    budget = point("compile-budget", 100, [1.2, 1.3, 1.4], cosine=1.0)
    close = point("fxmem", 90, [1.0, 1.1, 1.15], 0.996, "close")
    bent = point("fxmem", 80, [1.0, 1.0, 1.0], 0.99, "bent")
    overlapping = point("fxmem", 90, [1.0, 1.1, 1.25], 0.999, "overlapping")  # median 1.1 against 1.3, range not apart
    assert not bent.meets_fidelity_bound and close.meets_fidelity_bound and budget.meets_fidelity_bound
    assert wins([compiled, budget, close, bent]) == [(budget, close)]  # bent is lower and faster, but misses 0.995
    assert wins([compiled, budget, bent, overlapping]) == [(budget, None)]


def test_overrides_apply_to_the_budget_series_and_name_it():
    from fxmem.config import Config
    from fxmem_bench.frontier import frontier_points

    points = frontier_points([0.3], "hyclora-4bit", "hyclora-2bit", {"block_checkpoint": True})
    fxmem_points = {p.label: p.config for p in points if p.method == "fxmem"}
    assert fxmem_points == {
        "fxmem hyclora-4bit block_checkpoint=True 0.3": Config.from_preset("hyclora-4bit", memory_budget=0.3,
                                                                           block_checkpoint=True),
        "fxmem hyclora-2bit": Config.from_preset("hyclora-2bit")}
