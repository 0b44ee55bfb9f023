"""What inductor may capture in a CUDA graph (mode="reduce-overhead"): each graph fxmem hands it, read by inductor's
own test for what a capture cannot hold (an op tagged cudagraph_unsafe, a data-dependent size). The test reads the
graph, not a device, so it runs on the CPU."""

import importlib

import pytest
import torch
from torch._inductor.utils import is_cudagraph_unsafe_fx_node
from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import fxmem
from tests.conftest import tiny_model

backend_module = importlib.import_module("fxmem.backend")
# AOTAutograd keeps a recomputed random op's RNG state with these on the CPU only; on CUDA it emits
# graphsafe_run_with_rng_state, which a capture holds (torch/_functorch/partitioners.py, functionalize_rng_ops).
_CPU_RNG_STATE = (run_and_save_rng_state, run_with_rng_state)


def uncapturable(gm: torch.fx.GraphModule) -> list:
    """What inductor's get_first_incompatible_cudagraph_node would stop at, every one, as op targets."""
    return [n.target for n in gm.graph.nodes if n.target not in _CPU_RNG_STATE and (
        is_cudagraph_unsafe_fx_node(n) or free_unbacked_symbols(n.meta.get("val")))]


def graphs_for_inductor(monkeypatch, preset: str, **overrides) -> list[torch.fx.GraphModule]:
    """The forward and backward graphs of one training step of a tiny PEFT Llama, as inductor receives them."""
    seen = []
    lower = backend_module.compile_fx_inner

    def recording(gm, example_inputs, **kwargs):
        seen.append(gm)
        return lower(gm, example_inputs, **kwargs)

    monkeypatch.setattr(backend_module, "compile_fx_inner", recording)
    model, batch = tiny_model("llama", lora=True, layers=1)
    torch.compile(model, backend=fxmem.backend(preset, **overrides))(**batch).loss.backward()
    assert len(seen) == 2
    return seen


def test_dynamic_compression_and_the_chunked_loss_can_be_captured_whole(monkeypatch):
    graphs = graphs_for_inductor(monkeypatch, "hyclora-4bit", return_logits=False)  # the loss chunked
    assert any(n.target is torch.ops.fxmem.linear_cross_entropy.default for n in graphs[0].graph.nodes)
    assert [uncapturable(gm) for gm in graphs] == [[], []]


@pytest.mark.parametrize("preset, overrides, op", [
    ("hyclora-4bit", {"calibration": "static"}, torch.ops.fxmem.calibrated_params.default),
    ("loract", {"bits": None}, torch.ops.fxmem.lowrank_decompose_rows.default),  # factors even at this size
])
def test_ops_a_capture_cannot_hold_are_left_out_of_it(monkeypatch, preset, overrides, op):
    # Static calibration's state is Python, which a replay would skip; the low-rank factors' randomized SVD calls
    # torch.linalg.svd, which synchronizes with the host. Inductor keeps tagged ops out of its CUDA graphs (a partition of their own).
    forward, _ = graphs_for_inductor(monkeypatch, preset, **overrides)
    assert set(uncapturable(forward)) == {op}
