import dataclasses

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.analysis.liveness import graph_liveness, inlined_elementwise
from fxmem.backend import Backend
from fxmem.config import Config
from fxmem.measure import model_tensors, peak_memory, saved_activation_bytes
from tests.models import TINY_LLAMA


def test_a_storage_lives_from_its_op_to_its_last_reader_through_views():
    def f(x):
        a = x * 2  # 4 KiB, read by b and (through a view) by d
        b = a + 1  # 4 KiB, read by c
        c = b.sum()  # 4 bytes
        d = a.view(-1)[:16] * c  # 64 bytes: a freed after it
        return d

    graph = make_fx(f)(torch.randn(32, 32)).graph
    liveness = graph_liveness(graph)
    assert liveness.peak_bytes == 4096 + 4096 + 4  # a, b and c at once; the input is not counted
    assert liveness.end_bytes == 64  # only the output remains
    assert liveness.transient_bytes == liveness.peak_bytes - 64


def test_each_output_of_a_multi_output_op_lives_to_its_own_last_reader():
    def f(x):
        values, _ = torch.max(x, 1)  # 128 bytes of values, 256 of int64 indices that nothing reads
        return values * 2

    liveness = graph_liveness(make_fx(f)(torch.randn(32, 32)).graph)
    assert liveness.peak_bytes == 128 + 256  # both outputs as the op returns them; the indices freed at once
    assert liveness.end_bytes == 128


def test_a_released_input_is_freed_after_its_last_reader():
    def f(saved, weight):
        a = weight * 2  # 4 KiB
        b = a * saved  # 4 KiB: the saved input's last reader
        c = b + 1  # 4 KiB
        return c.sum()

    graph = make_fx(f)(torch.randn(32, 32), torch.randn(32, 32)).graph
    saved = next(iter(graph.find_nodes(op="placeholder")))
    liveness = graph_liveness(graph, released={saved: (saved, 4096)})
    # the input counted until b, its last reader: at b the input, a and b, 8 KiB beyond the input's bytes (freed
    # at the start it would be 4 KiB beyond: a and b)
    assert liveness.peak_bytes == 4096 + 4096 + 4096 - 4096
    assert graph_liveness(graph).peak_bytes == 4096 + 4096  # the input held to the end and not counted: a and b


def test_an_element_wise_op_read_only_inside_other_loops_is_not_stored():
    def f(x, w):
        c = torch.tanh(x)  # read by a matmul, which needs it stored
        a = x * 2  # read by b alone: computed inside b's loop
        b = a + 1  # read by the sum: inside the reduction's loop
        return b.sum() + (c @ w).sum()

    graph = make_fx(f)(torch.randn(32, 32), torch.randn(32, 32)).graph
    inlined = inlined_elementwise(graph)
    assert {n.name for n in inlined} == {"mul", "add"}  # not tanh, nor the last add, which the output reads
    stored = graph_liveness(graph, inlined=inlined)
    assert stored.peak_bytes == 4096 + 4096 + 4  # c, c @ w and one sum; a and b never stored
    assert graph_liveness(graph).peak_bytes == 3 * 4096  # run as aten ops: c, a and b at once


def test_a_chain_of_element_wise_sums_is_stored_where_inductor_stores_it():
    # a residual stream's gradient, summed layer after layer, each sum also read by a reduction: inlined whole, the
    # chain would hold every summand to its end (the whole backward's, on a mixture of experts)
    def chain(x, *summands):
        sums = []
        for summand in summands:
            x = x + summand
            sums.append(x.sum(-1))
        return torch.stack(sums)

    args = [torch.randn(64, 32) for _ in range(11)]
    adds = [n for n in make_fx(chain)(*args).graph.nodes if n.target == torch.ops.aten.add.Tensor]
    stored = [n for n in adds if n not in inlined_elementwise(adds[0].graph)]
    _, (code,) = run_and_get_code(torch.compile(chain, backend="inductor"), *args)
    assert len(stored) == code.count("empty_strided_cpu((64, 32)") == 2
    # several readers: stored once it loads more than 4 buffers (each sum loads one more)
    assert [adds.index(n) for n in stored] == [3, 7]


def test_a_constant_fill_is_never_stored_however_many_kernels_read_it():
    def f(x):
        zeros = torch.full((32, 32), 0.0)  # read by six scatters, as CSE shares one buffer of zeros among blocks
        parts = [torch.slice_scatter(zeros, x[:, :16] * i, dim=1, start=0, end=16) for i in range(6)]
        return torch.stack([p.sum() for p in parts])

    graph = make_fx(f)(torch.randn(32, 32)).graph
    [fill] = graph.find_nodes(op="call_function", target=torch.ops.aten.full.default)
    assert len(fill.users) == 6 and fill in inlined_elementwise(graph)
    # nothing of 32 x 32 is ever stored: the six sums (4 bytes each) and their stack
    assert graph_liveness(graph, inlined=inlined_elementwise(graph)).peak_bytes == 6 * 4 + 6 * 4


@torch.library.custom_op("fxmem_test::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    """An op inductor falls back to, as it does to fxmem's chunked ops."""
    return x.clone()


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


def _reuse_graph():
    def f(saved, w, x, v):
        a = torch.mm(saved, w)  # 8 KiB, made by inductor; the saved input's last reader
        s = a.sum()  # a's last reader: its buffer waits for the next allocation of its size
        y = _opaque(x * s)  # x * s stored for the opaque op: 4 KiB, as is y (which the op allocates)
        return torch.mm(y, v)  # 8 KiB, inductor's: it takes a's buffer

    graph = make_fx(f)(torch.randn(64, 32), torch.randn(32, 32), torch.randn(64, 16), torch.randn(16, 32)).graph
    return graph, next(iter(graph.find_nodes(op="placeholder")))


def _opaque_workspace(node):
    return 1 << 20 if node.target is torch.ops.fxmem_test.opaque.default else 0


def test_inductor_keeps_a_freed_buffer_across_an_opaque_op_while_its_estimate_has_room():
    graph, saved = _reuse_graph()
    released = {saved: (saved, 8192)}
    freed = graph_liveness(graph, _opaque_workspace, released=released)
    kept = graph_liveness(graph, _opaque_workspace, released=released, reuse_buffers=True)
    # inductor's estimate (no workspace, none of its own buffers) peaks at 8 KiB, the saved input, freed once a is
    # made: a's 8 KiB fit under it from the sum to the last mm, so a is held across the op's workspace
    assert kept.peak_bytes == freed.peak_bytes + 8192
    assert freed.peak_bytes == (1 << 20) + 4096 + 4096 - 8192  # x * s and y at the op, net of the input
    assert kept.end_bytes == freed.end_bytes == 8192


def test_without_released_inputs_a_buffer_is_reused_only_by_the_next_kernel():
    # forward: inductor's estimate is zero throughout, so nothing is held across the op
    graph, _ = _reuse_graph()
    assert graph_liveness(graph, _opaque_workspace, reuse_buffers=True) == graph_liveness(graph, _opaque_workspace)


def test_the_pool_hands_out_the_last_freed_buffer_first():
    def f(saved, w, x, x2, v):
        a1 = torch.mm(saved, w)  # 8 KiB, the saved input's last reader
        a2 = torch.mm(x2, w)  # 8 KiB, alive across the op
        s1 = a1.sum()  # a1 waits in the pool
        y = _opaque(x * s1)  # the op's workspace
        s2 = a2.sum(0)  # a2 waits too, freed last (s2 not of s1's size, which would wait for it)
        return torch.mm(y, v), s2  # 8 KiB: takes a2's buffer, the next kernel's; a1 is freed where it was

    graph = make_fx(f)(*(torch.randn(shape) for shape in ((64, 32), (32, 32), (64, 16), (64, 32), (16, 32)))).graph
    saved = next(iter(graph.find_nodes(op="placeholder")))
    released = {saved: (saved, 8192)}
    # first freed first, a1 would be held across the op's workspace: 8 KiB more
    assert graph_liveness(graph, _opaque_workspace, released=released, reuse_buffers=True) \
        == graph_liveness(graph, _opaque_workspace, released=released)


def _grouped_kernels_graph(compare):
    def f(x, w1, w2):
        a1, a2 = torch.mm(x, w1), torch.mm(x, w2)  # library calls: 4 KiB each
        return compare(a1), compare(a2)  # two generated kernels, one call between the matmul and the end

    return make_fx(f)(torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32)).graph


def test_kernels_between_library_calls_run_as_one_call_holding_all_their_inputs():
    # CPU inductor allocates a group's outputs before its one call and frees its inputs after it: a1 lives on
    # beside both masks (op by op it is freed before a2's mask exists)
    graph = _grouped_kernels_graph(lambda a: a > 0)
    assert graph_liveness(graph).peak_bytes == 4096 + 4096 + 1024
    assert graph_liveness(graph, group_kernels=True).peak_bytes == 4096 + 4096 + 1024 + 1024


def test_a_grouped_kernel_writes_its_output_over_an_input_it_is_the_last_to_read():
    # sin(a) of the same dtype and size goes into a's buffer (in_out_ptr): the two matmuls' outputs are the peak
    graph = _grouped_kernels_graph(torch.sin)
    assert graph_liveness(graph).peak_bytes == 3 * 4096
    assert graph_liveness(graph, group_kernels=True).peak_bytes == 2 * 4096


def test_a_grouped_kernel_does_not_write_over_another_kernels_input():
    def f(x, w, y):
        a = torch.mm(x, w)
        return a > 0, torch.sin(y)  # sin(y) reads y, a graph input, not a: its output takes a buffer of its own

    graph = make_fx(f)(torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32)).graph
    assert graph_liveness(graph, group_kernels=True).peak_bytes == 4096 + 1024 + 4096


def test_an_output_written_in_place_that_nothing_reads_is_freed_with_its_group():
    def f(x, w, y):
        torch.sin(torch.mm(x, w))  # written over the matmul's output, read by nothing
        return torch.cos(y)

    graph = make_fx(f)(torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 32)).graph
    assert graph_liveness(graph, group_kernels=True).end_bytes == graph_liveness(graph).end_bytes == 4096


def _region_and_measured_transients(preset, overrides, lowering):
    """A 256-token step of the tests' tiny Llama compiled with ``lowering``: its region, and the measured step peak
    beyond what forward saved."""
    model, batch = dataclasses.replace(TINY_LLAMA, batch=1, seq=256).build()
    backend = Backend(Config.from_preset(preset, return_logits=False, **overrides), lowering=lowering)
    forward = torch.compile(model, backend=backend)
    forward(**batch).loss.backward()  # compiles
    model.zero_grad(set_to_none=True)
    saved, loss = saved_activation_bytes(lambda: forward(**batch).loss,
                                         exclude=model_tensors(model) + list(batch.values()))
    loss.backward()
    model.zero_grad(set_to_none=True)
    peak = peak_memory(lambda: forward(**batch).loss.backward(), "cpu")
    [region] = backend.regions
    return region, peak - saved


# mlp_chunk 128 of 256 tokens: the MLP's backward stays the peak (at 64 it is CPU flash attention's backward, which
# holds about 130 KiB inside that no graph shows)
@pytest.mark.parametrize("preset, overrides", [("exact", {}), ("hyclora-4bit", {}), ("exact", {"mlp_chunk": 128}),
                                               ("exact", {"mlp_chunk": 128, "linear_chunk": 64})])
def test_transients_are_the_measured_step_peak_beyond_the_saved_bytes(preset, overrides):
    # Run as the graphs' own order runs them (lowering="eager"), a step's peak above what it saved is the region's
    # transients to the byte, up to the few bytes of scalars the profiler sees and the graphs do not. The chunked
    # MLP's op and the chunked loss's are opaque to the graph: what they hold inside is the cost model's
    # (op_workspace_bytes), and so is what the chunked linears' op holds.
    region, measured = _region_and_measured_transients(preset, overrides, "eager")
    assert region.transient_bytes == pytest.approx(measured, rel=0.01)


# The compiled step with its MLPs in chunks: inductor frees each saved activation after backward's last read of it,
# and keeps freed buffers for reuse across the chunked MLP's workspace (_reused_buffers: without it the model says
# 0.80x the measured under hyclora-4bit). The aten order with every saved tensor held to the end (transient_bytes)
# says 1.4x the measured under exact. Unchunked (exact 0.93x) and with the linears in chunks too (hyclora-4bit
# 0.93x) inductor's fused kernels hold more than the model counts (docs/long-context.md), so they are left out.
@pytest.mark.parametrize("preset, overrides, tolerance", [
    ("exact", {"mlp_chunk": 128}, 0.02),  # measured: 0.1%
    ("exact", {"mlp_chunk": 128, "linear_chunk": 64}, 0.02),
    ("hyclora-4bit", {"mlp_chunk": 128}, 0.05),  # measured: 1.034x the predicted
])
def test_compiled_transients_are_the_measured_inductor_step_beyond_the_saved_bytes(preset, overrides, tolerance):
    region, measured = _region_and_measured_transients(preset, overrides, "inductor")
    assert region.compiled_transient_bytes == pytest.approx(measured, rel=tolerance)
