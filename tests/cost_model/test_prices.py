import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fxmem.cost_model import prices


@pytest.mark.parametrize("causal, flops", [(False, 4 * 2 * 8 * 128 * 256 * 64), (True, 2 * 2 * 8 * 128 * 256 * 64)])
def test_an_attention_forward_is_priced_by_its_two_products_at_the_matmul_rate(monkeypatch, causal, flops):
    monkeypatch.setattr(prices, "matmul_rate", lambda device: 1e9)
    seconds = prices.attention_seconds(2, 8, 128, 256, 64, causal=causal, device="cpu")
    assert seconds == pytest.approx(flops / 1e9)


@torch.library.custom_op("fxmem_test::apply_matrices", mutates_args=())
def _apply_matrices(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return x @ first.T @ second.T


@_apply_matrices.register_fake
def _(x, first, second):
    return x.new_empty(x.shape[0], second.shape[0])


def test_a_replayed_forward_is_priced_by_its_flops_and_its_other_ops_bytes_views_free(monkeypatch):
    monkeypatch.setattr(prices, "matmul_rate", lambda device: 1e9)
    monkeypatch.setattr(prices, "memory_bandwidth", lambda device: 1e6)

    def forward(x, w, first, second, q):
        y = torch.relu(x @ w.t())  # w.t() a view: free; a (64 x 32) by (32 x 16) product; 64 x 16 written and read
        z = torch.ops.fxmem_test.apply_matrices(y.view(64, 16), first, second)  # 64 rows through 8 x 16 and 4 x 8
        mean, var = torch.var_mean(z, dim=-1)  # two outputs of 64, each written and read
        attention = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return z, mean, var, attention

    gm = make_fx(forward, tracing_mode="fake")(torch.randn(64, 32), torch.randn(16, 32), torch.randn(8, 16),
                                              torch.randn(4, 8), torch.randn(1, 2, 16, 8))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    flops = 2 * 64 * 32 * 16 + 2 * 64 * (8 * 16 + 4 * 8) + 4 * 1 * 2 * 16 * 16 * 8 // 2
    traffic = 2 * 64 * 16 * 4 + 2 * 2 * 64 * 4
    # fused attention (causal: half the flops) is priced by its flops alone, not its outputs' bytes
    assert any("flash_attention" in str(n.target) for n in nodes)
    assert prices.forward_seconds(nodes) == pytest.approx(flops / 1e9 + traffic / 1e6)


def _experts(x, index, a, b, offsets):
    """The routed rows gathered by expert and each expert's LoRA on them (fxmem/kernels/grouped_lora.py)."""
    import fxmem.kernels.grouped_lora  # noqa: F401  registers fxmem::grouped_lora

    return torch.ops.fxmem.grouped_lora(x[index], a, b, offsets)


def _experts_graph():
    offsets = torch.tensor([3, 8], dtype=torch.int32)
    gm = make_fx(_experts, tracing_mode="fake")(torch.randn(4, 16), torch.arange(8) % 4, torch.randn(2, 16, 3),
                                                torch.randn(2, 3, 12), offsets)
    return {str(n.target).split(".")[-2]: n for n in gm.graph.nodes if n.op == "call_function"}


def test_an_experts_grouped_lora_is_priced_through_its_rank(monkeypatch):
    monkeypatch.setattr(prices, "matmul_rate", lambda device: 1e9)
    monkeypatch.setattr(prices, "memory_bandwidth", lambda device: 1e6)
    node = _experts_graph()["grouped_lora"]
    # 8 routed rows through a (16 x 3) then a (3 x 12) factor of their expert
    assert prices.forward_seconds([node]) == pytest.approx(2 * 8 * 3 * (16 + 12) / 1e9)


def test_the_experts_replayed_products_hold_what_they_read_through_the_gathers_between():
    from types import SimpleNamespace

    from fxmem.cost_model.plan import Recompute
    from fxmem.cost_model.planner import replay_sources

    nodes = _experts_graph()
    rows, products = nodes["index"], nodes["grouped_lora"]
    recomputed = [(SimpleNamespace(storage=rows.name, rebuild_product=None), Recompute("", chain=(rows,))),
                  (SimpleNamespace(storage=products.name, rebuild_product=None),
                   Recompute("", chain=(products,)))]
    # x, not the routed rows (recomputed themselves): the second partition holds x at 8 bits or more
    x, index = rows.args[0].name, rows.args[1][0].name
    assert {x, index} <= replay_sources(recomputed) and rows.name not in replay_sources(recomputed)
    # a gather alone (no product) is no replay: nothing held for it
    assert replay_sources(recomputed[:1]) == frozenset()
